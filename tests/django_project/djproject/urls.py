from django.urls import path
from shop import views

urlpatterns = [
    path("orders/<int:order_id>/pay", views.pay),
    path("orders/<int:order_id>/notify", views.notify_customer),
]
