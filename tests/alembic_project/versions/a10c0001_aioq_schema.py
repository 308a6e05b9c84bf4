"""aioq's schema, version 0 to 13."""

from alembic import op

from aioq.migrate import schema_sql

revision = "a10c0001"
down_revision = None


def upgrade() -> None:
    op.execute(schema_sql("aioq", from_version=0, to_version=19))


def downgrade() -> None:
    op.execute('DROP SCHEMA "aioq" CASCADE')
