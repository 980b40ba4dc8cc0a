"""Tests of megatron-zero-bubble (a package, so tests/megatron is `tests.megatron`, never `megatron`)."""
