"""Tables and plots built from run directories only; training never draws.

``runs`` reads run directories and sweep indexes (``hafedho.sweep.index``) into sections of groups; ``stats``
computes a group's final, best and rounds-to-target values over seeds; ``layout`` places a section's groups in
rows and columns; ``table`` is the table model and its renderers (Markdown, CSV, LaTeX, HTML); ``tables`` builds
the tables, one module per kind plus its registry ``TABLES``; ``summary`` the long-format CSV rows; ``plots``
draws the figures; ``html`` builds the page (it references the PNGs beside it); ``paths`` prints paths
relative to the folder reported; ``build.write_report`` writes all of it
(``hafedho report``, and ``hafedho demo``'s table and plot).
"""
