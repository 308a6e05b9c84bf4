from django.db import connection, transaction
from django.http import HttpRequest, JsonResponse

from shop.models import Order
from shop.tasks import charge, notify


def pay(request: HttpRequest, order_id: int) -> JsonResponse:
    """Enqueue the charge in the view's transaction; ?fail=1 rolls it all back."""
    with transaction.atomic():
        order = Order.objects.create(id=order_id, customer="ann")
        result = charge.enqueue(order.id, card=request.GET.get("card", "ok"))
        if request.GET.get("fail"):
            raise RuntimeError("the view failed after enqueueing")
    return JsonResponse({"result_id": result.id})


def notify_customer(request: HttpRequest, order_id: int) -> JsonResponse:
    """Defer a native aioq task on Django's connection, in the view's transaction."""
    with transaction.atomic():
        order = Order.objects.create(id=order_id, customer="bob")
        job_id = notify.defer_sync(connection, order_id=order.id)
        if request.GET.get("fail"):
            raise RuntimeError("the view failed after deferring")
    return JsonResponse({"job_id": job_id})
