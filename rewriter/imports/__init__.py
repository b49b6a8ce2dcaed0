"""Import edits after a rewrite: the imports added, removed, kept (with a reason) and made dead."""
