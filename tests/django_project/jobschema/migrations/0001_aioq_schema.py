from django.db import migrations

from aioq.migrate import schema_sql


class Migration(migrations.Migration):
    dependencies: list[tuple[str, str]] = []
    operations = [
        migrations.RunSQL(
            # A list: Django runs the script as one statement instead of splitting it.
            [schema_sql("aioq", from_version=0, to_version=19)],
            reverse_sql=['DROP SCHEMA "aioq" CASCADE'],
        ),
    ]
