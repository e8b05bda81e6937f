"""A Django project whose Dramatiq broker is kumiko's, as docs/dramatiq.md shows it
("Django"): ``DJANGO_SETTINGS_MODULE=tests.apps.django_site.settings``. Tested in
tests/integration/test_ecosystem.py."""
