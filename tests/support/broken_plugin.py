"""A plugin module that fails on import (the loader's error test)."""

raise ImportError("this module is broken on purpose")
