"""``python -m flashport``: the same entry point as the ``flashport`` console script."""

from flashport.rewriter.app.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
