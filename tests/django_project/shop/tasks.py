"""The project's tasks: Django ones (@task, on the aioq backend) and a native aioq one."""

import asyncio
import dataclasses
import datetime
import enum
import uuid

from django.db import models
from django.db.models import F

import aioq
from shop.models import Log, Order

try:
    from django.tasks import task
except ImportError:  # Django 5.2
    from django_tasks import task


class PaymentDeclined(Exception):
    """Raised by charge() for a declined card."""


@task
def add(a, b):
    return a + b


@task
def charge(order_id, card):
    if card == "declined":
        raise PaymentDeclined(f"card declined for order {order_id}")
    Order.objects.filter(id=order_id).update(paid=True)  # the ORM, in the worker's thread
    return {"order": order_id, "paid": True}


@task(takes_context=True)
def whoami(context, note):
    return {"id": context.task_result.id, "attempt": context.attempt, "note": note}


@task
async def count_orders(customer):
    await asyncio.sleep(0)
    return await Order.objects.filter(customer=customer).acount()


@task(queue_name="emails", priority=10)
def record(label):
    Log.objects.create(label=label)


@task
def touch(order_id):
    """A sync task with an ORM write: the load test's job."""
    Order.objects.filter(id=order_id).update(notified=F("notified") + 1)


@task
async def atouch(order_id):
    """An async task with an ORM write: the load test's other job."""
    await Order.objects.filter(id=order_id).aupdate(notified=F("notified") + 1)


def not_a_task(x):
    """A plain function: a job naming it is refused."""


@aioq.task(queue="emails")
def notify(order_id: int) -> None:
    """A native aioq task, deferred from a view with defer_sync(connection, ...)."""
    Order.objects.filter(id=order_id).update(notified=F("notified") + 1)


class Size(models.IntegerChoices):
    SMALL = 1
    LARGE = 2


class Color(models.TextChoices):
    RED = "red"
    BLUE = "blue"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


@task
def describe(size, color, level=None, **extra):
    """A Django task: what its arguments are after Django's JSON round trip."""
    values = {"size": size, "color": color, "level": level, **extra}
    return {name: [value, type(value).__name__] for name, value in values.items()}


@dataclasses.dataclass(frozen=True)
class Reminder:
    order: uuid.UUID
    due: datetime.date
    size: Size


@aioq.task
def remind(reminder: Reminder, at: datetime.datetime) -> None:
    """A native aioq task with typed arguments, deferred on Django's connection."""
    kinds = [type(reminder).__name__, type(reminder.order).__name__, type(reminder.due).__name__]
    kinds += [type(reminder.size).__name__, type(at).__name__]
    Log.objects.create(label=" ".join(kinds))
