"""Print a WGSL kernel as the compiler gets it (the `show` command of the kernels package).

Usage: `python -m bitnet_web.kernels.show KERNEL [DEFINE ...] [NAME=VALUE ...]`. Snippets are
included, `//#if` blocks selected by the DEFINEs (e.g. DOT4 SUBGROUPS), `//#for` loops unrolled with
the integer constants given, and placeholders filled where a value is given (others stay `${NAME}`).
Example: `python -m bitnet_web.kernels.show ternary_gemv DOT4 K=2560 N=3840 ROWS=8 WG=64 ITERS=1`.
"""

from __future__ import annotations

import argparse
import sys

from .common import expanded_source, shader_dir


def _value(text: str) -> object:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text, text)


def main(argv: list[str] | None = None) -> int:
    kernels = sorted(p.stem for p in shader_dir().glob("*.wgsl") if not p.stem.startswith("_"))
    parser = argparse.ArgumentParser(prog="python -m bitnet_web.kernels.show", description=__doc__.splitlines()[0])
    parser.add_argument("kernel", choices=kernels, metavar="KERNEL", help=f"one of: {', '.join(kernels)}")
    parser.add_argument("settings", nargs="*", metavar="DEFINE|NAME=VALUE")
    args = parser.parse_args(argv)
    defines = tuple(s for s in args.settings if "=" not in s)
    constants = dict((k, _value(v)) for k, v in (s.split("=", 1) for s in args.settings if "=" in s))
    try:
        print(expanded_source(args.kernel, defines, **constants), end="")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
