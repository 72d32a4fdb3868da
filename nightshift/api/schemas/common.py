from __future__ import annotations

from typing import Generic, Literal, Optional, TypeVar

from pydantic import BaseModel

Item = TypeVar("Item")


class ListPage(BaseModel, Generic[Item]):
    """OpenAI's cursor page. The client reads ``data`` and ``has_more`` and asks for the
    next page with ``?after=<id of the last item>``."""

    object: Literal["list"] = "list"
    data: list[Item]
    first_id: Optional[str] = None
    last_id: Optional[str] = None
    has_more: bool = False

    @classmethod
    def of(cls, items: list, has_more: bool) -> "ListPage":
        return cls(data=items, has_more=has_more,
                   first_id=items[0].id if items else None,
                   last_id=items[-1].id if items else None)
