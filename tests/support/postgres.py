"""A PostgreSQL database of its own for each test that needs one.

The server is AUTOTUNE_TEST_POSTGRES (default postgresql://postgres@127.0.0.1:5432/postgres);
the tests of shared studies need it, as the report's browser test needs Chromium. Each
test creates a database with a unique name and drops it afterwards, also on failure.
"""

from __future__ import annotations

import os
import uuid

import psycopg2
import pytest
import sqlalchemy

SERVER = os.environ.get("AUTOTUNE_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres")


def run_on_server(sql: str) -> None:
    """One statement on the server's admin database, outside a transaction (CREATE and
    DROP DATABASE cannot run inside one)."""
    connection = psycopg2.connect(SERVER)
    connection.autocommit = True
    try:
        with connection.cursor() as cursor:
            cursor.execute(sql)
    finally:
        connection.close()


@pytest.fixture
def postgres_db():
    """(name, URL without a password) of a fresh database; dropped after the test."""
    name = f"autotune_test_{uuid.uuid4().hex[:12]}"
    run_on_server(f'CREATE DATABASE "{name}"')
    try:
        yield name, sqlalchemy.engine.make_url(SERVER).set(database=name).render_as_string(hide_password=False)
    finally:
        run_on_server(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def with_password(url: str, password: str) -> str:
    """The same URL with a password (the server trusts local connections, so any works)."""
    return sqlalchemy.engine.make_url(url).set(password=password).render_as_string(hide_password=False)
