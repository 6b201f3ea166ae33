# SPDX-License-Identifier: Apache-2.0
"""Fixtures for planner tests (helpers live in planner_fixtures.py)."""

import pytest
from planner_fixtures import simple_profile as _simple_profile


@pytest.fixture
def simple_profile():
    return _simple_profile()
