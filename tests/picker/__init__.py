# A package, so that its conftest is imported as picker.conftest and leaves the suite's own
# ``conftest`` (tests/conftest.py, which test modules import helpers from) in place.
