"""The product: the four services wired into `mempo sft|train|eval|serve` (see services/cli.py)."""
