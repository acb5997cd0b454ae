"""Write the options table into README.md (between its options-table markers) from
vllm_retrieval_spec/options.py; ``--check`` only says whether it is current (tests/test_options.py
runs the same comparison).

    python scripts/options_table.py [--check]"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from vllm_retrieval_spec.options import RetrievalSpecOptions

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"(<!-- options-table:start -->\n)(.*?)\n?(<!-- options-table:end -->)", re.DOTALL)


def readme_table(text: str) -> str | None:
    """The table between the markers (None without them)."""
    match = BLOCK.search(text)
    return match[2] if match else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 when README.md's table is not current")
    args = parser.parse_args(argv)
    text, table = README.read_text(), RetrievalSpecOptions.markdown_table()
    if readme_table(text) is None:
        print(f"{README}: no options-table markers", file=sys.stderr)
        return 1
    if args.check:
        current = readme_table(text) == table
        print("options table current" if current else "options table outdated: run scripts/options_table.py")
        return 0 if current else 1
    README.write_text(BLOCK.sub(lambda match: f"{match[1]}{table}\n{match[3]}", text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
