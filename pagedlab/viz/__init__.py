"""Figures and ipywidgets views of the book."""
