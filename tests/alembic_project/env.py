"""Run the revisions on ALEMBIC_URL, each in a transaction (Alembic's default)."""

import os

from alembic import context
from sqlalchemy import create_engine

engine = create_engine(os.environ["ALEMBIC_URL"])
with engine.connect() as connection:
    context.configure(connection=connection, transaction_per_migration=True)
    with context.begin_transaction():
        context.run_migrations()
