# A package, so that its conftest is imported as service.conftest and leaves the suite's own
# ``conftest`` (tests/conftest.py, which test modules import helpers from) in place.
