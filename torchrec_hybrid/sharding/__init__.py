"""The frequency-hybrid sharding and its runtime pieces (input dist, lookup, output dist)."""
