"""Helpers the tests share (no tests here): imported as `tests.support.<module>`; fixtures live in conftest.py."""
