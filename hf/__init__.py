"""Hugging Face export of run folders (export.py) and the files that ship inside every exported model."""
