"""On-disk formats: how tensors are laid out in files, with no loading logic."""
