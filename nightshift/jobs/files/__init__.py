"""Files: uploads streamed to the object store, their rows, listing and content."""
