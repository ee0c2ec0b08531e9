"""Test utilities shipped with the package so vendors can run the conformance suite on their backend."""
