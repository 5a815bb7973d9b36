"""Core statements run on the transaction's DBAPI cursor: the REST allocation's hot path (issue 14).

`Connection.execute` costs several times what the database spends on a small statement: an execution context,
events, a cache lookup and a result object on every call. On an allocation (fake driver, SQLite) that was most
of 1.2 ms of CPU, where sqlite3 alone spends 0.2-0.26 ms on the same seven statements.

A `Prepared` is the same Core construct, compiled by SQLAlchemy once per dialect and set of parameter names,
with the column types' own bind and result processors. So the SQL and the values sent are what
`Connection.execute` would send, and the rows are what it would return (as named tuples). A DBAPI error becomes
SQLAlchemy's exception for it (IntegrityError and the rest), as on `Connection.execute`. It runs in the
transaction the connection already holds, and takes no part in the ORM session's bookkeeping.

Statements that need more of SQLAlchemy's execution (Python-side column defaults, IN lists expanded at
execution, escaped parameter names) are refused when compiled, so they stay on `Connection.execute`.
"""

from __future__ import annotations

import threading
from collections import namedtuple
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import DBAPIError, InvalidRequestError
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import BindParameter

Processor = Callable[[Any], Any] | None


@dataclass(frozen=True, slots=True)
class _Bind:
    """Where one bound value comes from, fixed when the statement is compiled for a set of parameter names (what
    SQLCompiler.construct_params works out again at every execution): the caller's parameter `key`, else the
    bind's own value (`own`: computed at each execution when the bind has a callable)."""

    name: str  # in the SQL
    key: str | None
    value: Any
    own: BindParameter[Any] | None
    processor: Processor

    def sent(self, params: Mapping[str, Any]) -> Any:
        value = params[self.key] if self.key is not None else \
            self.value if self.own is None else self.own.effective_value
        return value if self.processor is None else self.processor(value)


@dataclass(frozen=True, slots=True)
class _Compiled:
    sql: str
    positional: tuple[_Bind, ...] | None  # qmark/format: in SQL order
    named: tuple[_Bind, ...]  # named/pyformat
    row: Callable[..., Any] | None  # builds a named tuple from a row's values; None: no result columns
    results: tuple[Processor, ...]


class Prepared:
    """One Core statement (select, insert, update, delete) run on the DBAPI cursor; see the module."""

    def __init__(self, statement: ClauseElement) -> None:
        self.statement = statement
        self._compiled: dict[tuple[str, frozenset[str]], _Compiled] = {}
        self._lock = threading.Lock()

    def rows(self, connection: Connection, params: Mapping[str, Any] | None = None) -> list[Any]:
        """Every row the statement returns (none for DML without RETURNING)."""
        params = params or {}
        dialect = connection.dialect
        compiled = self._compiled.get((dialect.name, frozenset(params)))
        if compiled is None:
            compiled = self._compile(dialect, params)
        if compiled.positional is not None:
            sent: Any = [bind.sent(params) for bind in compiled.positional]
        else:
            sent = {bind.name: bind.sent(params) for bind in compiled.named}
        cursor = connection.connection.cursor()
        try:
            try:
                cursor.execute(compiled.sql, sent)
                fetched = cursor.fetchall() if compiled.row is not None else []
            except dialect.loaded_dbapi.Error as exc:
                raise DBAPIError.instance(compiled.sql, sent, exc, dialect.loaded_dbapi.Error,
                                          dialect=dialect) from exc
        finally:
            cursor.close()
        if compiled.row is None:
            return []
        make, results = compiled.row, compiled.results
        if not any(results):
            return [make(*row) for row in fetched]
        return [make(*(value if proc is None else proc(value) for proc, value in zip(results, row, strict=True)))
                for row in fetched]

    def first(self, connection: Connection, params: Mapping[str, Any] | None = None) -> Any | None:
        found = self.rows(connection, params)
        return found[0] if found else None

    def scalar(self, connection: Connection, params: Mapping[str, Any] | None = None) -> Any:
        """The first column of the first row; None when there is no row."""
        found = self.first(connection, params)
        return None if found is None else found[0]

    def execute(self, connection: Connection, params: Mapping[str, Any] | None = None) -> None:
        self.rows(connection, params)

    def _compile(self, dialect: Dialect, params: Mapping[str, Any]) -> _Compiled:
        keys = frozenset(params)
        with self._lock:
            found = self._compiled.get((dialect.name, keys))
            if found is not None:
                return found
            compiled = self.statement.compile(dialect=dialect, column_keys=sorted(keys))
            if not isinstance(compiled, SQLCompiler):
                raise TypeError(f"not a SQL statement: {self.statement!r}")
            refused = [what for what, present in (
                ("Python-side column defaults", compiled.insert_prefetch or compiled.update_prefetch),
                ("parameters rendered at execution (IN lists, literal execute)",
                 compiled.literal_execute_params or compiled.post_compile_params),
                ("escaped parameter names", compiled.escaped_bind_names)) if present]
            if refused:
                raise ValueError(f"statement needs SQLAlchemy's execution ({', '.join(refused)}): {compiled}")
            binds = {name: _bind_of(bind, name, keys, dialect) for bind, name in compiled.bind_names.items()}
            positional = tuple(binds[name] for name in compiled.positiontup or ()) if compiled.positional else None
            named = tuple(binds.values())
            columns = list(getattr(self.statement, "exported_columns", ()))
            if compiled.isinsert or compiled.isupdate or compiled.isdelete:
                columns = columns if compiled.effective_returning else []
            row = namedtuple("Row", [c.key for c in columns], rename=True) if columns else None
            results = tuple(c.type.dialect_impl(dialect).result_processor(dialect, None) for c in columns)
            found = self._compiled[(dialect.name, keys)] = _Compiled(str(compiled), positional, named, row, results)
            return found


def _bind_of(bind: BindParameter[Any], name: str, keys: frozenset[str], dialect: Dialect) -> _Bind:
    """As SQLCompiler.construct_params takes the bind's value (by the bind's key, then its name), for a caller
    that passes the parameters `keys`."""
    key = bind.key if bind.key in keys else name if name in keys else None
    if key is None and bind.required:
        raise InvalidRequestError(f"A value is required for bind parameter {bind.key!r}")
    return _Bind(name, key, bind.value, bind if key is None and bind.callable else None,
                 bind.type.dialect_impl(dialect).bind_processor(dialect))
