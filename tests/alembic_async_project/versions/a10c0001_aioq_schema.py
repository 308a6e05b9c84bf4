"""aioq's schema, version 0 to 13, on an async (asyncpg) Alembic env."""

from alembic import op
from sqlalchemy.util import await_only

from aioq.migrate import schema_sql

revision = "a10c0001"
down_revision = None


def upgrade() -> None:
    # asyncpg prepares each statement SQLAlchemy sends, and a prepared statement holds one
    # command: run the script on asyncpg's own connection, in the revision's transaction.
    asyncpg_conn = op.get_bind().connection.driver_connection
    await_only(asyncpg_conn.execute(schema_sql("aioq", from_version=0, to_version=19)))


def downgrade() -> None:
    op.execute('DROP SCHEMA "aioq" CASCADE')
