"""torchrec-hybrid."""
