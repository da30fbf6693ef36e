"""DLRM training example for torchrec-hybrid (see README.md)."""
