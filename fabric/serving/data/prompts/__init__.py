"""Prompt texts for `semfab bench tokens --dataset sonnet` (not tokenizer training text)."""
