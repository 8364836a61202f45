"""The APIs the appliance serves, one folder per family: its API objects, rules, shape, routes."""
