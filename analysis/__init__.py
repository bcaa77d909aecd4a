"""Pure functions over Arrow tables: the schema, attribution, aggregation, comparison.

Nothing here reads or writes files, touches a GPU or prints.
"""

from decodescope.analysis.schema import SCHEMA_VERSION, UNATTRIBUTED, Run, RunMeta, SchemaError

__all__ = ["SCHEMA_VERSION", "UNATTRIBUTED", "Run", "RunMeta", "SchemaError"]
