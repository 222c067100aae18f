"""Command-line entry point ``fedjx-run`` (see scripts/run.py)."""


def main() -> None:
  raise SystemExit('fedjx-run: the experiment runner is not built yet.')
