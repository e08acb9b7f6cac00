"""The tests, by layer; each file is named after the module it tests."""
