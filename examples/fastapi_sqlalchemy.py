"""A FastAPI + SQLAlchemy app: the welcome job commits with the user, in the session's transaction.

POST /signup adds a user through an ``AsyncSession`` and defers ``send_welcome`` on that same
session: the job is written on the session's connection, inside its transaction, so both commit
or neither does. Three ways for the transaction not to commit, and no job in any of them:

- ``dry_run``: the handler rolls the session back on purpose;
- a blocked email domain: an exception raised inside ``session.begin()`` after the defer;
- an email already taken: the INSERT fails at the flush, inside ``session.begin()``.

The worker in the same process runs the jobs. Run it with

    AIOQ_DSN=postgresql://... uvicorn --factory examples.fastapi_sqlalchemy:app_from_env
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

import asyncpg
from fastapi import Depends, FastAPI, HTTPException, Request
from pydantic import BaseModel
from sqlalchemy import BigInteger, ForeignKey, String, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

import aioq

registry = aioq.Registry()
BLOCKED_DOMAINS = frozenset({"spam.example"})


class Base(DeclarativeBase):
    pass


class User(Base):
    __tablename__ = "sa_users"
    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    email: Mapped[str] = mapped_column(String, unique=True)


class Welcome(Base):
    __tablename__ = "sa_welcomes"
    user_id: Mapped[int] = mapped_column(ForeignKey("sa_users.id"), primary_key=True)
    job_id: Mapped[int] = mapped_column(BigInteger)


_sessions: list[async_sessionmaker[AsyncSession]] = []


@registry.task(queue="email")
async def send_welcome(user_id: int, email: str) -> None:
    """Record the welcome once per user, however many times the job runs (idempotent)."""
    job = aioq.current_job()
    async with _sessions[-1]() as session, session.begin():
        if await session.get(Welcome, user_id) is None:
            session.add(Welcome(user_id=user_id, job_id=job.id))


def asyncpg_url(dsn: str) -> str:
    """Return a ``postgresql://`` DSN as a SQLAlchemy URL on the asyncpg driver."""
    scheme, rest = dsn.split("://", 1)
    if scheme not in ("postgres", "postgresql"):
        raise ValueError(f"expected a postgresql:// DSN, got {scheme}://")
    return f"postgresql+asyncpg://{rest}"


class Signup(BaseModel):
    email: str
    dry_run: bool = False


class Signed(BaseModel):
    user_id: int | None
    job_id: int
    committed: bool


class Counts(BaseModel):
    users: int
    welcomes: int
    jobs: int  # still in the queue (pending, running or dead)


async def session_dependency(request: Request) -> AsyncIterator[AsyncSession]:
    """One session per request."""
    maker: async_sessionmaker[AsyncSession] = request.app.state.sessions
    async with maker() as session:
        yield session


SessionDep = Annotated[AsyncSession, Depends(session_dependency)]


def create_app(dsn: str, *, concurrency: int = 10) -> FastAPI:
    """Build the app; its lifespan owns the engine, the schema and the worker."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = create_async_engine(asyncpg_url(dsn))
        async with asyncpg.create_pool(dsn, min_size=1, max_size=4) as pool:
            async with pool.acquire() as conn:
                await aioq.install(conn, schema=registry.schema)
            async with engine.begin() as sa_conn:
                await sa_conn.run_sync(Base.metadata.create_all)
            app.state.sessions = maker = async_sessionmaker(engine, expire_on_commit=False)
            app.state.pool = pool
            _sessions.append(maker)
            worker = aioq.Worker(
                dsn=dsn, registry=registry, queues=["email"], concurrency=concurrency
            )
            try:
                async with worker:
                    yield
            finally:
                _sessions.remove(maker)
                await engine.dispose()

    app = FastAPI(lifespan=lifespan)

    @app.post("/signup", status_code=201)
    async def signup(body: Signup, session: SessionDep) -> Signed:
        if body.dry_run:  # everything a real signup does, then rolled back on purpose
            user = User(email=body.email)
            session.add(user)
            await session.flush()
            job_id = await send_welcome.defer(session, user_id=user.id, email=body.email)
            await session.rollback()
            return Signed(user_id=None, job_id=job_id, committed=False)
        try:
            async with session.begin():
                user = User(email=body.email)
                session.add(user)
                await session.flush()  # assigns user.id (and fails here if the email is taken)
                job_id = await send_welcome.defer(session, user_id=user.id, email=body.email)
                if body.email.rpartition("@")[2] in BLOCKED_DOMAINS:
                    raise HTTPException(422, f"{body.email}: this domain is not accepted")
        except IntegrityError:
            raise HTTPException(409, f"{body.email} is already signed up") from None
        return Signed(user_id=user.id, job_id=job_id, committed=True)

    @app.post("/resend/{user_id}", status_code=202)
    async def resend(user_id: int, session: SessionDep, request: Request) -> Signed:
        user = await session.get(User, user_id)
        if user is None:
            raise HTTPException(404, f"no user {user_id}")
        # No business row to commit with: an asyncpg pool runs the insert in its own transaction.
        pool: asyncpg.Pool = request.app.state.pool
        job_id = await send_welcome.defer(pool, user_id=user.id, email=user.email)
        return Signed(user_id=user.id, job_id=job_id, committed=True)

    @app.get("/counts")
    async def counts(session: SessionDep, request: Request) -> Counts:
        users = await session.scalar(select(func.count()).select_from(User))
        welcomes = await session.scalar(select(func.count()).select_from(Welcome))
        # aioq's admin functions take the session too, or an asyncpg pool.
        jobs = await aioq.admin.list_jobs(session, task=send_welcome.name, schema=registry.schema)
        return Counts(users=users or 0, welcomes=welcomes or 0, jobs=len(jobs))

    return app


def app_from_env() -> FastAPI:
    """Build the app from AIOQ_DSN (for ``uvicorn --factory``)."""
    return create_app(os.environ["AIOQ_DSN"])
