"""A Django app with a plain Dramatiq actor (``tasks``) and a kumiko job (``jobs``)."""
