from django.db import models


class Order(models.Model):
    customer = models.CharField(max_length=100)
    paid = models.BooleanField(default=False)
    notified = models.IntegerField(default=0)


class Log(models.Model):
    """One row per run of shop.tasks.record, in run order."""

    label = models.CharField(max_length=100)
