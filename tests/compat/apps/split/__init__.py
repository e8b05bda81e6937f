"""Actors spread over modules of a package (:mod:`tests.compat.apps.split_actors`)."""
