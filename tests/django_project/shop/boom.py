"""A module with import-time side effects, which no job may make a worker import.

tests/test_django.py names ``shop.boom.cleanup`` in a job: were the worker to import this
module, it would leave a marker file behind and stop the process.
"""

import os
import sys

marker = os.environ.get("AIOQ_TEST_BOOM_MARKER")
if marker:
    with open(marker, "w") as imported:
        imported.write("imported\n")
sys.exit(3)


def cleanup():
    """Never reached."""
