"""Figures and views of the book that work without a kernel."""
