"""Synthetic documents for extraction runs: invoices, CVs, support emails, paper first pages, product listings.

Each document is raw text of the kind ``gramserve extract`` reads, matching one schema of ``schemas/`` (the kind
names are the schema file names). Every value comes from small word lists and a few layouts per kind, so a run
of hundreds of documents has varied names, numbers, dates, currencies, layouts and lengths (300-1500
characters) without any real person's data. Output is deterministic for a seed, and document ``i`` depends only
on ``(seed, i)``: the first ``n`` documents of a larger run are the same ``n`` documents.

    from benchmarks.extraction_docs import synthetic_documents
    docs = synthetic_documents(300, seed=0, kinds=("invoice",))   # [{"id", "kind", "text"}, ...]

    python benchmarks/extraction_docs.py --n 300 --kind invoice --out docs.jsonl
    python benchmarks/extraction_docs.py --n 50 --out - | head -1       # all kinds, to stdout
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import sys
from collections.abc import Callable, Sequence

KINDS = ("invoice", "person", "support_ticket", "paper", "product")
MIN_CHARS, MAX_CHARS = 300, 1500

# ------------------------------------------------------------------------------------------------
# Word lists (invented organisations; example.* domains; fictional phone ranges)

FIRST = (
    "Amara Lucas Ingrid Rahul Chloé Tomasz Harriet Kwame Sophie Beatriz Daniel Yusuf Priya Owen Grace Tobias "
    "Marisol Wei-Lin Adebayo Sun-Hee Eleanor Kofi Jonas Laleh Diego Aiko Nadia Emil Fatima Hugo Ines Mateo "
    "Olivia Pavel Rosa Samir Tessa Viktor Yara Zoltan Leila Jun Astrid Felix Noor Rafael Sienna Arjun"
).split()
LAST = (
    "Okonkwo Ferreira Solberg Venkataraman Martin Wieczorek Ng Asante Tremblay Ocampo Whitcombe Demirci "
    "Raghunathan Takahashi Adeyemi Krenn Echeverria Chou Okafor Park Fitzwilliam Mensah Everaert Farahani "
    "Santacruz Moriyama Haddad Lindqvist Bakker Novak Rossi Kowalski Dubois Moreau Schneider Costa Silva "
    "Nakamura Ivanova Horvat Petrov Andersen Quispe Bairstow Marsh Iturriaga Vries Brandt Kaur Mbeki"
).split()
COMPANY_STEMS = (
    "Brightwater Nordlicht Fenwick Sakuragawa Northern-Pine Vistaar Tidewater Harrowgate Selcombe Kestrel "
    "Bluefjord Copperline Silverbirch Oakhollow Redmarsh Greystone Lakeshore Highmoor Riverton Eastmoor Sunfield "
    "Westwind Ironbridge Alder Cobalt Juniper Marigold Orchard Quarry Saltmarsh Thistle Willowbank Zephyr Larkspur"
).split()
COMPANY_TRADES = (
    "Consulting, Logistics, Analytics, Print, Translation Services, Landscaping, Cloud Solutions, Engineering, "
    "Dental Group, Catering, Architects, Software, Textiles, Office Supplies, Media, Freight, Electrical, "
    "Design Studio, Legal Services, Bakery, Hotel Group, Medical Devices, Accounting, Retail, Health"
).split(", ")
COMPANY_SUFFIX = ("Ltd", "LLC", "GmbH", "Inc.", "S.A.", "B.V.", "AB", "Pty Ltd", "K.K.", "Pvt. Ltd.", "AS", "KG")
CITIES = (  # city, country, currency, phone number pattern (# = a random digit; US/UK/AU: ranges kept for fiction)
    ("Portland", "USA", "USD", "+1 (503) 555-01##"),
    ("Columbus", "USA", "USD", "(614) 555-01##"),
    ("Hamburg", "Germany", "EUR", "+49 40 0000 ###"),
    ("Munich", "Germany", "EUR", "+49 89 0000 ###"),
    ("Leeds", "United Kingdom", "GBP", "+44 7700 900###"),
    ("Bristol", "United Kingdom", "GBP", "07700 900###"),
    ("Nagoya", "Japan", "JPY", "+81 52-000-0###"),
    ("Sudbury", "Canada", "CAD", "+1 705 555 01##"),
    ("Toronto", "Canada", "CAD", "(416) 555-01##"),
    ("Bengaluru", "India", "INR", "+91 98000 00###"),
    ("Pune", "India", "INR", "+91 90000 00###"),
    ("Lyon", "France", "EUR", "+33 4 00 00 0# ##"),
    ("Trondheim", "Norway", "NOK", "+47 400 00 ###"),
    ("Porto Alegre", "Brazil", "BRL", "+55 51 90000-0###"),
    ("Kraków", "Poland", "PLN", "+48 500 000 ###"),
    ("Rotterdam", "Netherlands", "EUR", "+31 6 0000 0###"),
    ("Gothenburg", "Sweden", "SEK", "+46 70 000 0###"),
    ("Adelaide", "Australia", "AUD", "+61 491 570 ###"),
    ("Cape Town", "South Africa", "ZAR", "+27 21 000 0###"),
    ("Valencia", "Spain", "EUR", "+34 600 000 ###"),
    ("Zurich", "Switzerland", "CHF", "+41 44 000 0# ##"),
)
MONTHS = "January February March April May June July August September October November December".split()

# currency: (symbol as printed, typical tax rates, tax name, rough units per US dollar)
CURRENCIES = {
    "USD": ("$", (0.0, 0.0625, 0.0725, 0.08), "Sales tax", 1),
    "EUR": ("€", (0.19, 0.20, 0.21, 0.10), "VAT", 0.92),
    "GBP": ("£", (0.20, 0.0), "VAT", 0.79),
    "CHF": ("CHF ", (0.081,), "MWST", 0.88),
    "JPY": ("JPY ", (0.10,), "Consumption tax", 150),
    "CAD": ("CA$", (0.13, 0.05, 0.15), "HST", 1.36),
    "AUD": ("A$", (0.10,), "GST", 1.52),
    "SEK": ("SEK ", (0.25,), "Moms (VAT)", 10.6),
    "NOK": ("NOK ", (0.25,), "MVA", 10.8),
    "PLN": ("PLN ", (0.23,), "VAT", 4.0),
    "BRL": ("R$", (0.05,), "ISS", 5.0),
    "ZAR": ("R ", (0.15,), "VAT", 18.5),
    "INR": ("INR ", (0.18,), "IGST", 83),
}
CROSS_BORDER = ("USD", "EUR", "GBP")  # what an invoice or listing is priced in when not in the local currency


def _currency(rng: random.Random, local: str) -> str:
    return local if rng.random() < 0.8 else rng.choice(CROSS_BORDER)


# trade group: (trades a vendor of the group has, [(description, lowest and highest unit price in USD, fewest and
# most units)])
SERVICES = {
    "it": (
        ("Software", "Cloud Solutions", "Consulting", "Analytics"),
        [
            ("Website maintenance (hours)", 40, 140, 2, 30),
            ("Consulting, strategy workshop (days)", 600, 1800, 1, 5),
            ("Software licence, per user per year", 60, 900, 1, 50),
            ("Cloud hosting, monthly plan", 20, 900, 1, 12),
            ("Data migration (fixed fee)", 500, 9000, 1, 1),
            ("Staff training session", 300, 2500, 1, 4),
            ("On-call support retainer (months)", 200, 1500, 1, 12),
            ("Security audit and report", 1500, 8000, 1, 1),
        ],
    ),
    "office": (
        ("Office Supplies", "Print", "Design Studio"),
        [
            ("Office chair, ergonomic", 120, 600, 1, 20),
            ("Printer toner cartridge, black", 30, 110, 1, 40),
            ("A4 copy paper, box of 5 reams", 18, 45, 1, 60),
            ("Business cards, 500 pcs", 25, 90, 1, 10),
            ("A5 flyers, full colour, 1000 pcs", 60, 220, 1, 5),
            ("Graphic design, logo revisions", 25, 120, 1, 6),
            ("Delivery and installation (flat rate)", 50, 400, 1, 1),
            ("Standing desk, electric", 350, 900, 1, 10),
        ],
    ),
    "professional": (
        ("Legal Services", "Accounting", "Translation Services", "Architects"),
        [
            ("Legal review of contract (hours)", 120, 450, 1, 20),
            ("Annual accounts preparation", 800, 4000, 1, 1),
            ("Payroll processing, per employee", 8, 25, 5, 120),
            ("Translation, per word", 0.08, 0.25, 800, 20000),
            ("Proofreading by second linguist", 150, 900, 1, 1),
            ("Site visit and measurements", 200, 900, 1, 3),
            ("Planning application drawings", 900, 6000, 1, 1),
        ],
    ),
    "facilities": (
        ("Landscaping", "Electrical", "Catering", "Freight"),
        [
            ("Snow clearing visit", 60, 160, 1, 20),
            ("Lawn mowing and edging", 40, 120, 1, 16),
            ("Electrical inspection and certificate", 150, 500, 1, 3),
            ("LED panel light 60x60, supplied and fitted", 25, 90, 2, 80),
            ("Catering, lunch per person", 9, 35, 8, 120),
            ("Freight, pallet Hamburg-Rotterdam", 90, 350, 1, 24),
            ("Emergency call-out", 120, 300, 1, 2),
        ],
    ),
}

# career track: (job titles from junior to senior, sectors, skills, degrees, employers' trades)
CAREERS = (
    (
        ("Junior Developer", "Software Developer", "Senior Software Engineer", "Lead Engineer", "Engineering Manager"),
        ("fintech", "e-commerce", "logistics software", "health tech"),
        ("Python", "Java", "TypeScript", "React", "Kubernetes", "Docker", "PostgreSQL", "AWS", "Git", "Linux", "CI/CD"),
        ("BSc Computer Science", "BEng Software Engineering", "MSc Computer Science"),
        ("Software", "Cloud Solutions", "Analytics", "Media"),
    ),
    (
        ("Data Analyst", "BI Developer", "Data Engineer", "Senior Data Engineer", "Head of Data"),
        ("retail", "insurance", "logistics", "media"),
        ("SQL", "Python", "dbt", "Airflow", "Kafka", "Spark", "Tableau", "Power BI", "data modelling", "Terraform"),
        ("BSc Mathematics", "MSc Data Science", "BSc Statistics"),
        ("Analytics", "Retail", "Logistics", "Insurance"),
    ),
    (
        ("Accounts Assistant", "Financial Analyst", "Senior Financial Analyst", "Finance Manager", "Finance Director"),
        ("manufacturing", "hospitality", "property", "non-profit"),
        ("Excel", "SAP", "financial reporting", "budgeting", "forecasting", "IFRS", "Power BI", "audit", "payroll"),
        ("BA Economics", "BSc Accounting and Finance", "MBA"),
        ("Accounting", "Hotel Group", "Property", "Engineering"),
    ),
    (
        ("Staff Nurse", "Senior Staff Nurse", "Clinical Nurse Specialist", "Nurse Practitioner", "Ward Manager"),
        ("acute care", "paediatrics", "community health", "oncology"),
        ("patient assessment", "medication management", "triage", "wound care", "EPIC", "mentoring", "audit"),
        ("BSc Nursing", "MSc Advanced Clinical Practice"),
        ("General Hospital", "Health Trust", "Medical Centre", "Care Group"),
    ),
    (
        ("Marketing Assistant", "Marketing Specialist", "Content Manager", "Marketing Manager", "Head of Marketing"),
        ("consumer goods", "travel", "software", "education"),
        ("SEO", "Google Analytics", "copywriting", "HubSpot", "social media", "A/B testing", "Figma", "budgeting"),
        ("BA Marketing", "BA Communication", "MA Marketing"),
        ("Media", "Retail", "Travel", "Software"),
    ),
    (
        ("Production Planner", "Quality Engineer", "Production Manager", "Plant Director", "VP Operations"),
        ("automotive parts", "food processing", "packaging", "medical devices"),
        ("Lean manufacturing", "Six Sigma", "SAP", "S&OP", "supplier negotiation", "ISO 9001", "root-cause analysis"),
        ("BEng Mechanical Engineering", "BSc Industrial Engineering", "MBA"),
        ("Engineering", "Medical Devices", "Textiles", "Precision Components"),
    ),
)
ACHIEVEMENTS = (
    "Led a team of {n} people through a reorganisation without losing anyone.",
    "Cut the monthly reporting effort by {n}% by automating the data collection.",
    "Introduced a weekly review that halved the number of escalations.",
    "Trained {n} new colleagues and wrote the onboarding handbook.",
    "Managed a budget of about {n}0,000 per year.",
    "Ran the migration to a new system on time, with no downtime for customers.",
    "Won the internal award for the best project of the year.",
    "Represented the company at {n} trade fairs and conferences.",
)
UNIVERSITIES = (
    "University of Eastmoor, Calder Valley University, Highmoor University, Riverton University, "
    "Lindqvist Institute of Technology, University of Northern Fjords, Deccan Science College, "
    "Université des Alpes-Rhodaniennes, Salzach University of Applied Sciences, Flemish Coast University, "
    "Kansai Institute of Technology, Federal Institute of Southern Plains"
).split(", ")

DIGITAL_PRODUCTS = (
    "CloudNote Pro, HomeBank Plus app, LedgerLite app, StreamBox Family, FiberGo 500 internet plan, PhotoVault "
    "storage plan, TillMaster T400 terminal, Pulsewave Band 3"
).split(", ")
PHYSICAL_PRODUCTS = (
    "Solano 4-person tent, Aurelia glass kettle, AeroSound NC700 headphones, KitchenPro KP-6D cooker, Trailhead "
    "merino socks, Zephyr e-bike, Pulsewave Band 3, TillMaster T400 terminal"
).split(", ")

# ------------------------------------------------------------------------------------------------
# Small helpers


def _name(rng: random.Random) -> str:
    last = rng.choice(LAST)
    if rng.random() < 0.15:
        last = f"{last}-{rng.choice(LAST)}"
    return f"{rng.choice(FIRST)} {last}"


def _email(rng: random.Random, name: str) -> str:
    first, last = name.split(" ", 1)
    local = rng.choice((f"{first}.{last}", f"{first[0]}.{last}", f"{first}{rng.randint(1, 99)}", f"{last}.{first}"))
    local = local.lower().replace(" ", "").replace("é", "e")
    host = rng.choice(("mail", "inbox", "post", "correo", "mailbox"))
    return f"{local}@{host}.example.{rng.choice(('com', 'org', 'net'))}"


def _phone(rng: random.Random, pattern: str) -> str:
    return "".join(str(rng.randrange(10)) if c == "#" else c for c in pattern)


def _company(rng: random.Random, trades: Sequence[str] = COMPANY_TRADES) -> str:
    stem, trade = rng.choice(COMPANY_STEMS).replace("-", " "), rng.choice(trades)
    if trade in ("General Hospital", "Health Trust", "Medical Centre"):
        return f"{stem} {trade}"
    return f"{stem} {trade} {rng.choice(COMPANY_SUFFIX)}"


def _date(rng: random.Random, first_year: int = 2021, last_year: int = 2025) -> dt.date:
    start = dt.date(first_year, 1, 1)
    return start + dt.timedelta(days=rng.randrange((dt.date(last_year, 12, 31) - start).days))


def _fmt_date(d: dt.date, style: int) -> str:
    return (
        f"{MONTHS[d.month - 1]} {d.day}, {d.year}",
        f"{d.day:02d}.{d.month:02d}.{d.year}",
        d.isoformat(),
        f"{d.day} {MONTHS[d.month - 1][:3]} {d.year}",
        f"{d.year}/{d.month:02d}/{d.day:02d}",
    )[style]


def _money(amount: float, code: str, symbol: str) -> str:
    if code == "JPY":
        return f"{symbol}{amount:,.0f}"
    text = f"{amount:,.2f}"
    if code in ("EUR", "SEK"):  # 1.234,56
        text = text.replace(",", "_").replace(".", ",").replace("_", ".")
        return f"{text} €" if code == "EUR" else f"{symbol}{text}"
    return f"{symbol}{text}"


def _fit(kind: str, rng: random.Random, size: int) -> str:
    """Build with `size` parts, fewer while the text runs past MAX_CHARS; pad a short text to MIN_CHARS."""
    build, _, _, pads = BUILDERS[kind]
    state = rng.getstate()
    while True:
        rng.setstate(state)  # the same choices, fewer parts
        text = build(rng, size)
        if len(text) <= MAX_CHARS or size <= 1:
            break
        size -= 1
    text = text[:MAX_CHARS]
    for pad in pads:
        if len(text) >= MIN_CHARS:
            break
        text += "\n\n" + pad
    return text


# ------------------------------------------------------------------------------------------------
# One builder per kind: build(rng, size) -> text


def _invoice(rng: random.Random, size: int) -> str:
    trades, catalogue = SERVICES[rng.choice(sorted(SERVICES))]
    vendor = _company(rng, trades)
    customer = _company(rng) if rng.random() < 0.75 else _name(rng)
    city, country, local, _ = rng.choice(CITIES)
    code = _currency(rng, local)
    symbol, rates, tax_name, per_usd = CURRENCIES[code]
    if code != local:
        rates, tax_name = (0.0,), "VAT (reverse charge)" if code == "EUR" else "Tax"
    issued = _date(rng)
    style = rng.randrange(5)
    due = None if rng.random() < 0.15 else issued + dt.timedelta(days=rng.choice((7, 14, 30, 45, 60)))
    number = rng.choice(
        (
            f"INV-{issued.year}-{rng.randint(1, 9999):04d}",
            f"{rng.randint(100, 99999)}",
            f"{vendor[:3].upper()}/{issued.year % 100}-{rng.randint(1, 999):03d}",
            f"RE-{rng.randint(10000, 99999)}",
        )
    )
    lines, subtotal = [], 0.0
    for desc, low, high, qlow, qhigh in rng.sample(catalogue, min(size, len(catalogue))):
        qty = rng.randint(qlow, qhigh)
        price = round(rng.uniform(low, high) * per_usd, 0 if code == "JPY" and high > 1 else 2)
        amount = round(qty * price, 2)
        subtotal += amount
        lines.append((desc, qty, price, amount))
    rate = rng.choice(rates)
    tax = round(subtotal * rate, 0 if code == "JPY" else 2)
    m = lambda x: _money(x, code, symbol)  # noqa: E731
    head = [
        vendor.upper() if rng.random() < 0.5 else vendor,
        f"{rng.randint(1, 400)} {rng.choice(COMPANY_STEMS).replace('-', ' ')} Street, {city}, {country}",
        "",
        rng.choice(("INVOICE", "TAX INVOICE", "Invoice", "SALES INVOICE")),
        f"Invoice {rng.choice(('no.', '#', 'number'))}: {number}",
        f"{rng.choice(('Date', 'Issue date', 'Invoice date'))}: {_fmt_date(issued, style)}",
        f"Due: {_fmt_date(due, style)}" if due else "Payment terms: due on receipt",
        "",
        f"{rng.choice(('Bill to', 'Invoice to', 'Customer'))}: {customer}",
        "",
    ]
    layout = rng.randrange(3)
    body = []
    if layout == 0:
        body.append(f"{'Description':<42}{'Qty':>6}{'Unit price':>16}{'Amount':>16}")
        body += [f"{d:<42}{q:>6}{m(p):>16}{m(a):>16}" for d, q, p, a in lines]
    elif layout == 1:
        body += [f"{q} x {d} @ {m(p)} = {m(a)}" for d, q, p, a in lines]
    else:
        body += [
            f"{i}. {d}\n   quantity {q}, unit price {m(p)}, line total {m(a)}"
            for i, (d, q, p, a) in enumerate(lines, 1)
        ]
    tax_line = f"{tax_name} ({rate * 100:g}%): {m(tax)}" if rate else f"{tax_name}: {m(0)} (exempt)"
    foot = [
        "",
        f"Subtotal: {m(subtotal)}",
        tax_line,
        f"{rng.choice(('Total due', 'TOTAL', 'Amount due', 'Grand total'))} ({code}): {m(subtotal + tax)}",
        "",
        rng.choice(
            (
                "Please pay by bank transfer and quote the invoice number.",
                "Thank you for your business!",
                "Late payments incur interest of 1% per month.",
            )
        ),
    ]
    return "\n".join(head + body + foot)


def _person(rng: random.Random, size: int) -> str:
    name = _name(rng)
    city, country, _, phone = rng.choice(CITIES)
    titles, sectors, skill_pool, degree_pool, employers = rng.choice(CAREERS)
    sector = rng.choice(sectors)
    end = rng.randint(2022, 2025)
    top = min(len(titles) - 1, size - 1 + rng.randint(0, 1))  # the current title's seniority
    jobs, year = [], end
    for i in range(size):
        start = year - rng.randint(1, 7)
        current = i == 0 and rng.random() < 0.75
        jobs.append((titles[max(top - i, 0)], _company(rng, employers), start, None if current else year))
        year = start - rng.randint(0, 1)
    grad = year - rng.randint(0, 1)
    degrees = [(rng.choice(degree_pool), rng.choice(UNIVERSITIES), grad - 3 * k) for k in range(rng.randint(1, 2))]
    skills = rng.sample(skill_pool, rng.randint(3, min(len(skill_pool), 3 + 2 * size)))
    skills += rng.sample(("English (fluent)", "Spanish (basic)", "German (B2)", "public speaking", "mentoring"), 1)
    total = end - jobs[-1][2]
    years = f"{total} year{'s' if total != 1 else ''}"
    contact = [("Location", f"{city}, {country}")]
    if rng.random() < 0.85:
        contact.append(("Email", _email(rng, name)))
    if rng.random() < 0.7:
        contact.append(("Phone", _phone(rng, phone)))
    values = [v for _, v in contact]
    # a line of what was done in some of the jobs (longer CVs)
    done = {i: rng.choice(ACHIEVEMENTS).format(n=rng.randint(3, 40)) for i in range(size) if rng.random() < 0.6}
    span = lambda s, e: f"{s} - {e if e else 'present'}"  # noqa: E731
    now = "currently" if jobs[0][3] is None else "most recently"
    layout = rng.randrange(3)
    if layout == 0:
        parts = [name.upper(), jobs[0][0], " | ".join(values), "", "PROFILE"]
        parts.append(f"{jobs[0][0]} with {years} of experience in {sector}.")
        parts += ["", "EXPERIENCE"]
        for i, (t, c, s, e) in enumerate(jobs):
            parts += [f"{t}, {c}, {span(s, e)}", *([f"- {done[i]}"] if i in done else [])]
        parts += ["", "EDUCATION"] + [f"{d}, {u}, {y}" for d, u, y in degrees]
        parts += ["", "SKILLS", ", ".join(skills)]
    elif layout == 1:
        parts = [f"Name: {name}", *(f"{k}: {v}" for k, v in contact)]
        parts += ["", f"Summary: {years} in {sector}, {now} {jobs[0][0].lower()}."]
        parts += ["", "Work history"]
        for i, (t, c, s, e) in enumerate(jobs):
            parts.append(f"* {t} - {c} ({span(s, e)})" + (f": {done[i][0].lower()}{done[i][1:]}" if i in done else ""))
        parts += ["", "Education: " + "; ".join(f"{d}, {u} ({y})" for d, u, y in degrees)]
        parts += ["", "Skills: " + ", ".join(skills)]
    else:
        t, c, s, e = jobs[0]
        where = f"where I have worked since {s}" if e is None else f"from {s} to {e}"
        parts = [f"Curriculum Vitae - {name}", "", "Contact: " + " · ".join(values), ""]
        parts.append(
            f"{'I am' if e is None else 'Most recently I was'} {t.lower()} at {c}, {where}. I have "
            f"{years} of experience in {sector}." + (f" {done[0]}" if 0 in done else "")
        )
        parts += [""] + [f"{s2}-{e2 or 'now'}  {t2}, {c2}" for t2, c2, s2, e2 in jobs]
        parts += ["", "Studies"] + [f"{y}  {d}, {u}" for d, u, y in degrees]
        parts += ["", "Competences: " + " · ".join(skills)]
    return "\n".join(parts)


TICKET_BODIES = (  # category, products it can be about, the message
    (
        "billing",
        DIGITAL_PRODUCTS + PHYSICAL_PRODUCTS,
        "I was charged {amount} twice for {product} on {date}. The order number is {order}. Please refund the "
        "duplicate payment.",
    ),
    (
        "shipping",
        PHYSICAL_PRODUCTS,
        "My order {order} for the {product} was due {date} but tracking has not moved for {days} days. Where is "
        "my parcel? If it can't arrive this week, please cancel the order.",
    ),
    (
        "product_defect",
        PHYSICAL_PRODUCTS,
        "The {product} I bought on {date} (order {order}) broke after {days} days of normal use. I would "
        "like a replacement.",
    ),
    (
        "technical_issue",
        DIGITAL_PRODUCTS,
        "Since the last update the {product} crashes every time I open the settings page. I have reinstalled "
        "twice. I need it working for work tomorrow.",
    ),
    (
        "account_access",
        DIGITAL_PRODUCTS,
        "I can't log in to my {product} account: the reset email never arrives. Please help me get back in; "
        "my username is the address I'm writing from.",
    ),
    (
        "feature_request",
        DIGITAL_PRODUCTS,
        "I really enjoy the {product}. Would it be possible to add an export to CSV? It would save me "
        "a lot of time every month.",
    ),
    (
        "returns",
        PHYSICAL_PRODUCTS,
        "I'd like to return the {product} from order {order}; it is not what I expected. It is unused and in its box. "
        "How do I get a return label?",
    ),
)
TONES = (
    ("Hello,", "Thanks in advance,", ""),
    ("Hi team,", "Cheers,", " Keep up the good work!"),
    ("To whom it may concern,", "Regards,", " This is unacceptable and I expect an answer today."),
    ("Dear support,", "Kind regards,", " I have been a loyal customer for {years} years."),
)


BACKGROUND = (
    "Some background: I have used the {product} for a long time and never had a problem before.",
    "I bought it as a present for my sister, so this is quite embarrassing for me.",
    "We use it every day in our small office of {n} people, so this affects all of us.",
    "I'm writing on behalf of my father, who is not comfortable with email.",
    "This is my second message about this; the first one was {n} days ago.",
)


def _support_ticket(rng: random.Random, size: int) -> str:
    name = _name(rng)
    category, products, body = rng.choice(TICKET_BODIES)
    greet, close, extra = rng.choice(TONES[:2] if category == "feature_request" else TONES)  # no anger at a wish
    values = {
        "product": rng.choice(products),
        "order": rng.choice(
            (f"#{rng.randint(10, 99)}-{rng.randint(10000, 99999)}", f"ORD-{rng.randint(100000, 999999)}")
        ),
        "date": _fmt_date(_date(rng, 2024, 2025), rng.randrange(5)),
        "amount": _money(rng.uniform(5, 400), "USD", "$"),
        "days": rng.randint(2, 40),
        "years": rng.randint(2, 15),
    }
    paragraphs = [body.format(**values) + extra.format(**values)]
    follow_ups = (
        "I already contacted you by chat last week but nobody got back to me.",
        "You can reach me on this email address at any time.",
        "Please let me know what information you need from me.",
        "I've read the help center article but it did not solve it.",
        "I would appreciate a quick answer.",
        "My account is registered under this email address.",
    )
    if rng.random() < 0.5:
        paragraphs.insert(0, rng.choice(BACKGROUND).format(product=values["product"], n=rng.randint(3, 30)))
    paragraphs += rng.sample(follow_ups, min(size, len(follow_ups)))
    header = []
    if rng.random() < 0.6:
        header = [
            f"From: {name} <{_email(rng, name)}>",
            f"Subject: {values['product']} - {category.replace('_', ' ')}",
            "",
        ]
    sign = name if rng.random() < 0.85 else name.split()[0]
    return "\n".join([*header, greet, "", *paragraphs, "", close, sign])


METHODS = (
    "Graph Neural Networks, Bayesian Hierarchical Models, Contrastive Pretraining, Mixed-Integer Programming, "
    "Randomised Field Trials, Low-Rank Adapters, Agent-Based Simulation, Satellite Imagery, Paired Catchment "
    "Studies, Federated Learning"
).split(", ")
TASKS = (
    "Flood Forecasting, Crop Yield Prediction, Protein Stability, Fraud Detection, Urban Heat Mapping, Energy "
    "Demand Forecasting, Hospital Readmission, Code Completion, Soil Carbon Estimation, Traffic Signal Control"
).split(", ")
SETTINGS = (
    "Small Upland Catchments, Low-Resource Languages, Rural Clinics, Smallholder Farms, Coastal Cities, "
    "Microcontroller Networks, Public Transport Systems, Dryland Regions"
).split(", ")
VENUES = (
    "Journal of Applied Freshwater Ecology, Materials Letters Express, Proceedings of the Conference on Machine "
    "Learning Systems, IEEE Transactions on Embedded Sensing Systems, Journal of Regional Economics, Annals of "
    "Digital Health, Computational Agronomy Review"
).split(", ")


INTRO = (
    "Reliable {task} matters for the people who plan around it, yet most methods were developed for data-rich "
    "settings.",
    "In {setting}, measurements are sparse, irregular and often collected by volunteers.",
    "Earlier work either ignores this sparsity or fills the gaps with simple interpolation.",
    "We ask how much can be gained by modelling the structure of the data directly.",
    "Our contributions are a new dataset, a method that uses it, and an evaluation against four baselines.",
)


def _paper(rng: random.Random, size: int) -> str:
    method, task, setting = rng.choice(METHODS), rng.choice(TASKS), rng.choice(SETTINGS)
    title = rng.choice(
        (
            f"{method} for {task} in {setting}",
            f"Improving {task} with {method}: Evidence from {setting}",
            f"How Much Can {method} Improve {task}? A Study in {setting}",
        )
    )
    year = rng.randint(2015, 2025)
    authors = [(_name(rng), rng.choice(UNIVERSITIES)) for _ in range(min(size + rng.randint(0, 2), 8))]
    venue = None if rng.random() < 0.25 else rng.choice(VENUES)
    doi = (
        None
        if venue is None or rng.random() < 0.2
        else f"10.5555/{rng.randint(1000, 99999)}.{year}.{rng.randint(1, 999)}"
    )
    gain = rng.randint(3, 45)
    n = rng.choice((120, 850, 2300, 14000, 96000))
    abstract = (
        f"{task} in {setting.lower()} remains difficult because data are scarce and noisy. We apply "
        f"{method.lower()} to {n:,} observations collected over {rng.randint(2, 12)} years. Compared with the "
        f"strongest baseline, our approach improves accuracy by {gain}% and halves the error in the worst-served "
        f"{rng.choice(('regions', 'groups', 'seasons', 'sites'))}. We release code and data to support replication."
    )
    keywords = [k.lower() for k in (method, task, setting)] + rng.sample(
        ["open data", "reproducibility", "uncertainty", "climate adaptation", "benchmarking", "policy"], 2
    )
    head = [f"{venue} ({year})" if venue else f"Preprint, {MONTHS[rng.randrange(12)]} {year}. Not peer reviewed.", ""]
    if doi:
        head += [f"DOI: {doi}", ""]
    head += [title if rng.random() < 0.6 else title.upper(), ""]
    if rng.random() < 0.5:
        head.append(", ".join(f"{a}({i})" for i, (a, _) in enumerate(authors, 1)))
        head += [f"({i}) {u}" for i, (_, u) in enumerate(authors, 1)]
    else:
        head += [f"{a}, {u}" for a, u in authors]
    if rng.random() < 0.3:
        head.append(f"Correspondence: {_email(rng, authors[0][0])}")
    text = [*head, "", "Abstract", abstract, "", "Keywords: " + "; ".join(keywords)]
    if rng.random() < 0.5:  # the first page often shows the start of the introduction
        intro = rng.sample(INTRO, rng.randint(1, len(INTRO)))
        text += ["", "1. Introduction", " ".join(intro).format(task=task.lower(), setting=setting.lower())]
    return "\n".join(text)


# name | category | colours | sizes | material | price range in USD | weight range in kg | electronic (e) or not (-)
PRODUCT_TABLE = """
Wireless Headphones | Electronics > Headphones | Black, Silver, Midnight blue | - | Aluminium | 40-450 | 0.2-0.4 | e
Hiking Boot | Shoes > Hiking boots | Slate grey, Brown, Olive | EU 39, EU 42, US 10 | Nubuck | 60-280 | 0.9-1.6 | -
Merino Sweater | Clothing > Knitwear | Forest green, Navy, Oatmeal | S, M, L, XL | Merino wool | 35-180 | 0.3-0.6 | -
Pressure Cooker | Home & Kitchen > Small appliances | Stainless | 6 qt, 8 qt | Stainless steel | 50-220 | 4-7 | e
Writing Desk | Furniture > Desks | Honey oak, White, Walnut | 120 x 60 cm, 140 x 70 cm | Oak | 80-900 | 18-40 | -
Mirrorless Camera Body | Cameras > Mirrorless | Black, Silver | - | Magnesium alloy | 50-2500 | 0.4-0.8 | e
E-Bike | Sports > Bicycles | Matte grey, Red | M, L | Aluminium | 700-4500 | 19-28 | e
Backpack 30L | Bags > Backpacks | Black, Sand, Teal | 30 L | Recycled nylon | 30-220 | 0.6-1.4 | -
Table Lamp | Home & Kitchen > Lighting | Brass, Matte black, White | 45 cm tall | Ceramic | 25-240 | 1-3 | e
"""


def _product_types() -> list[tuple]:
    rows = []
    for line in PRODUCT_TABLE.strip().splitlines():
        name, category, colours, sizes, material, price, weight, electronic = (c.strip() for c in line.split("|"))
        span = lambda text: tuple(float(x) for x in text.split("-"))  # noqa: E731
        sizes_ = None if sizes == "-" else tuple(sizes.split(", "))
        rows.append(
            (name, category, tuple(colours.split(", ")), sizes_, material, span(price), span(weight), electronic == "e")
        )
    return rows


PRODUCT_TYPES = _product_types()
CONDITIONS = (  # condition, how a listing says it, only for electronics
    ("new", "Condition: New", False),
    ("new", "Brand new, sealed in box", False),
    ("open_box", "Open box - opened for display, never used", False),
    ("refurbished", "Refurbished by the manufacturer, 1-year warranty", True),
    ("used_like_new", "Used - like new, barely worn", False),
    ("used_good", "Used - good condition, light signs of use", False),
    ("used_fair", "Used - fair, visible scratches", False),
    ("for_parts", "For parts or repair only - does not power on", True),
)


ABOUT = (
    "This {kind} is made for everyday use and built to last for years.",
    "The {material} was chosen for its durability and low weight.",
    "Every unit is checked by hand before it leaves our warehouse.",
    "Please compare the measurements with your current one before ordering.",
    "Photos show the actual item; colours may look slightly different on screen.",
)


def _product(rng: random.Random, size: int) -> str:
    kind, category, colors, sizes, material, (low, high), (light, heavy), electronic = rng.choice(PRODUCT_TYPES)
    brand = rng.choice(COMPANY_STEMS).replace("-", "")
    model = rng.choice((f"{rng.choice('XZRK')}{rng.randint(2, 9)}00", "Pro", "Lite", "Air", f"{rng.randint(2, 7)}"))
    name = f"{brand} {kind} {model}"
    code = _currency(rng, rng.choice(CITIES)[2])
    symbol, per_usd = CURRENCIES[code][0], CURRENCIES[code][3]
    price = round(rng.uniform(low, high) * per_usd, -1 if code == "JPY" else 0)
    if code != "JPY":
        price -= rng.choice((0.01, 0.05, 0))
    _, condition, _ = rng.choice([c for c in CONDITIONS if electronic or not c[2]])
    lines = [name, "", f"Price: {_money(price, code, symbol)}", condition]
    attributes = [f"Colour: {rng.choice(colors)}", f"Material: {material}"]
    if sizes:
        attributes.append(f"Size: {rng.choice(sizes)}")
    if rng.random() < 0.5:
        attributes.append(f"Weight: {rng.uniform(light, heavy):.1f} kg")
    rng.shuffle(attributes)
    features = (
        "Two-year warranty included.",
        "Free delivery, returns within 30 days.",
        "Ships in recycled packaging.",
        "Customer rating 4.5 out of 5.",
        "Compatible accessories sold separately.",
        "Bundle discount when bought with a second item.",
    )
    lines += ["", *attributes, "", *(f"- {f}" for f in rng.sample(features, min(size, len(features))))]
    if rng.random() < 0.5:
        about = rng.sample(ABOUT, rng.randint(1, len(ABOUT)))
        lines += ["", "About this item", " ".join(about).format(kind=kind.lower(), material=material.lower())]
    stock = rng.choice(("In stock", "Only 2 left in stock", "Sold out", "Pre-order: ships next month", "Available"))
    lines += ["", stock, f"Category: {category}"]
    if rng.random() < 0.6:
        slug = name.lower().replace(" ", "-")
        lines.append(f"https://{brand.lower()}.example.com/products/{slug}")
    if rng.random() < 0.5:
        lines.insert(1, f"by {brand}")
    return "\n".join(lines)


FOOTERS = (
    "For questions about this document, reply to this message and quote the reference above.",
    "Confidential: intended only for the addressee. If you received it by mistake, please delete it.",
)
BUILDERS: dict[str, tuple[Callable[[random.Random, int], str], int, int, tuple[str, ...]]] = {
    # kind: (builder, fewest parts, most parts, what a short document is padded with)
    "invoice": (_invoice, 1, 8, ("Questions about this invoice? Write to our accounts team.", *FOOTERS)),
    "person": (_person, 1, 4, ("References available on request.", "Driving licence: yes.", *FOOTERS)),
    "support_ticket": (_support_ticket, 1, 4, ("Sent from my phone, sorry for any typos.", *FOOTERS)),
    "paper": (_paper, 1, 6, ("Funding: this work received no specific grant.", *FOOTERS)),
    "product": (_product, 1, 5, ("Questions about this item? Ask the seller before buying.", *FOOTERS)),
}


# ------------------------------------------------------------------------------------------------


def synthetic_documents(n: int, seed: int = 0, kinds: Sequence[str] = KINDS) -> list[dict]:
    """`n` documents {"id", "kind", "text"}, the kinds taken in turn from `kinds`; deterministic for `seed`."""
    kinds = tuple(kinds)
    unknown = [k for k in kinds if k not in BUILDERS]
    if unknown or not kinds:
        raise ValueError(f"unknown kinds {unknown}; expected some of {', '.join(KINDS)}")
    if n < 0:
        raise ValueError("n must be >= 0")
    docs = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        rng = random.Random(f"{seed}:{i}:{kind}")  # str seeds hash with SHA-512: stable across runs and platforms
        _, low, high, _ = BUILDERS[kind]
        docs.append({"id": f"{kind}-{seed}-{i:05d}", "kind": kind, "text": _fit(kind, rng, rng.randint(low, high))})
    return docs


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=100, help="how many documents (default 100)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kind", action="append", choices=KINDS, help="a kind to generate (repeatable; default: all, in turn)"
    )
    parser.add_argument("--out", default="-", help="JSON Lines file to write ('-': stdout)")
    args = parser.parse_args(argv)
    docs = synthetic_documents(args.n, args.seed, tuple(args.kind) if args.kind else KINDS)
    out = sys.stdout if args.out == "-" else open(args.out, "w", encoding="utf-8")
    try:
        for doc in docs:
            out.write(json.dumps(doc, ensure_ascii=False) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
    if args.out != "-":
        print(f"wrote {len(docs)} documents to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
