"""The one error type of the planning layer (its own module so that every other module can import it)."""


class ScheduleError(ValueError):
    """A schedule, or the request for one, is wrong; the message is one sentence naming what."""
