"""The data path: sources → decode → pack/format → loader → augment (see DESIGN.md)."""
