"""Tables and plots built from run directories only; training never draws.

``runs`` reads run directories and sweep indexes into sections of groups; ``tables`` computes and renders the
tables (Markdown, CSV, LaTeX, HTML); ``plots`` draws the figures; ``html`` builds the self-contained page;
``build.write_report`` writes all of it (``hafedho report``).
"""
