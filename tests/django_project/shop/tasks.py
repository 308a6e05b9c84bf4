"""The project's tasks: Django ones (@task, on the aioq backend) and a native aioq one."""

import asyncio

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
