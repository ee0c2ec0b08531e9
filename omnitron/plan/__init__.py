"""``omnitron plan``: predict a layout's memory per pipeline stage before launch (:mod:`.memory`)."""
