"""The request layer: everything between an API request and a model forward that needs no tensor library.

Model registry, tokenizer and chat templates, incremental detokenizer, sampling parameters, errors, a
request's sequence, the scheduler and its paged block manager, grammar-constrained decoding, and what an
engine step returns (``outputs``). The gateway and the worker import from here; this package never imports
torch or triton, which ``make lint`` checks with import-linter's contract in ``pyproject.toml``.
"""
