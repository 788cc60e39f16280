"""Write pip requirement lines for one image, taken from pyproject.toml (the one source of versions).

Each image installs only what it runs: the gateway has no torch, the loadgen image only Locust and
plotting. Run in a Dockerfile build stage:

    python requirements_from_pyproject.py pyproject.toml --all-core --exclude torch --dep celery
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def requirement_name(requirement: str) -> str:
    match = _NAME.match(requirement)
    if match is None:
        raise ValueError(f"cannot read a package name from {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def select(pyproject: dict, all_core: bool, deps: list[str], exclude: list[str]) -> list[str]:
    project = pyproject["project"]
    core = list(project.get("dependencies", []))
    extras = [req for group in project.get("optional-dependencies", {}).values() for req in group]
    by_name = {requirement_name(req): req for req in extras + core}  # core wins on a clash
    wanted = [requirement_name(req) for req in core] if all_core else []
    for dep in deps:
        name = requirement_name(dep)
        if name not in by_name:
            raise SystemExit(f"{dep!r} is not a dependency or extra in pyproject.toml")
        wanted.append(name)
    dropped = {requirement_name(name) for name in exclude}
    seen: set[str] = set()
    lines = []
    for name in wanted:
        if name in dropped or name in seen:
            continue
        seen.add(name)
        lines.append(by_name[name])
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pyproject")
    parser.add_argument("--all-core", action="store_true", help="every [project.dependencies] entry")
    parser.add_argument("--dep", action="append", default=[], help="one named dependency or extra")
    parser.add_argument("--exclude", action="append", default=[], help="drop this package")
    args = parser.parse_args(argv)
    with open(args.pyproject, "rb") as handle:
        pyproject = tomllib.load(handle)
    sys.stdout.write("".join(line + "\n" for line in select(pyproject, args.all_core, args.dep, args.exclude)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
