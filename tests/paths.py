"""Where the tests find the project's folders (imported by module name: tests/conftest.py puts tests/ on sys.path)."""

import os

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
RECIPES = os.path.join(ROOT, "recipes")
BENCH = os.path.join(ROOT, "bench")
FIXTURES = os.path.join(TESTS, "fixtures")
