"""One file per parallel dimension, each applied to the plain model from outside."""
