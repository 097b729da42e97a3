"""Recipes and the checks before work: the convert and search recipes, registered-method fields, preflight.

The convert recipe, loadable from YAML and the convert flow's parameter (:mod:`.convert_recipe`), the
search's recipe (:mod:`.search_recipe`), recipe fields naming a registered method (:mod:`.registered`) and
everything a recipe decides, resolved and checked before any expensive step (:mod:`.preflight`).
"""
