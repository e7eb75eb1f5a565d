"""Dependencies shared by the routes (``Annotated`` aliases, as in the FastAPI template)."""

from __future__ import annotations

from typing import Annotated, Iterator

from fastapi import Depends, Request
from sqlalchemy.orm import Session, sessionmaker

from artifacts.interfaces import BlobStore
from kiln.settings import Settings


# Plain attribute reads are ``async def``: FastAPI runs a sync dependency on a worker thread, a hop per request.
async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_sessions(request: Request) -> sessionmaker[Session]:
    return request.app.state.sessions


def get_session(request: Request) -> Iterator[Session]:
    with request.app.state.sessions() as session:
        yield session


async def get_store(request: Request) -> BlobStore:
    return request.app.state.store


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionsDep = Annotated[sessionmaker[Session], Depends(get_sessions)]
SessionDep = Annotated[Session, Depends(get_session)]
StoreDep = Annotated[BlobStore, Depends(get_store)]
