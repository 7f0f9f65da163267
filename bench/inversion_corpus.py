"""The two corpora of the inversion benchmark (bench/inversion_bench.py): the attacker's training text and a
disjoint, held-out test text, each of several kinds.

* training ("what the attacker can run through the front"): the partition tool's built-in English text
  (``partition_tools/data/sample.txt``, Python reference prose), Python source from a fixed list of standard-library
  modules (read from this interpreter's stdlib; the benchmark records the corpus hash), chat dialogues, Chinese
  paragraphs and number-heavy records written for this file;
* test ("what users send"): chat, code, Chinese, numbers and English prose written for this file, on other
  topics and with other system prompts; numbers come from another seed. No test document occurs in the
  training text (:func:`check_disjoint`).

Chat documents go through the tokenizer's chat template, as the edge sends them.
"""

from __future__ import annotations

import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STDLIB_MODULES = ("textwrap.py", "shlex.py", "fnmatch.py", "bisect.py")  # training code
STDLIB_CHARS = 9000  # characters taken from the start of each module


@dataclass(frozen=True, slots=True)
class Document:
    kind: str  # "chat", "code", "chinese", "numbers", "prose"
    text: str  # the text as tokenized (chat already templated)


# -- training text written for this file ---------------------------------------------------------------------

TRAIN_CHATS = [
    ("You are a concise assistant.", [
        ("user", "What is the capital of Australia?"),
        ("assistant", "The capital of Australia is Canberra, not Sydney as many people assume."),
        ("user", "Why was Canberra chosen?"),
        ("assistant", "It was a compromise between Sydney and Melbourne, the two largest cities, which both "
                      "wanted to be the capital. The site was chosen in 1908 and the city was purpose-built."),
    ]),
    ("You help people cook at home.", [
        ("user", "How long should I boil an egg for a runny yolk?"),
        ("assistant", "About six minutes from the moment the water boils again, then cool it in cold water "
                      "for a minute so it stops cooking."),
        ("user", "And for a hard-boiled one?"),
        ("assistant", "Ten to eleven minutes. Older eggs peel more easily than very fresh ones."),
    ]),
    ("You are a patient maths tutor.", [
        ("user", "Can you explain what a prime number is?"),
        ("assistant", "A prime number is a whole number greater than one whose only divisors are one and "
                      "itself. Two, three, five, seven and eleven are the first few primes."),
        ("user", "Is one a prime?"),
        ("assistant", "No. By convention one is neither prime nor composite, which keeps the factorisation "
                      "of every number into primes unique."),
    ]),
    ("You are a travel planning assistant.", [
        ("user", "I have three days in Lisbon. What should I see?"),
        ("assistant", "Spend the first day in Alfama and the castle, the second in Belem with the tower and "
                      "the monastery, and the third on a day trip to Sintra. Take tram 28 at least once."),
        ("user", "Is it easy to get around without a car?"),
        ("assistant", "Yes. The metro, trams and buses cover the city, and trains to Sintra and Cascais "
                      "leave every twenty minutes or so."),
    ]),
    ("You are a helpful assistant for software developers.", [
        ("user", "My git push is rejected with 'non-fast-forward'. What does that mean?"),
        ("assistant", "Someone pushed commits to the remote branch that you do not have. Run git pull "
                      "--rebase to put your commits on top of theirs, resolve any conflicts, then push again."),
        ("user", "Can I just force push?"),
        ("assistant", "Only if you are sure nobody else uses the branch; a force push throws their commits "
                      "away. Prefer --force-with-lease, which refuses if the remote moved since you fetched."),
    ]),
    ("You answer questions about health in general terms and suggest seeing a doctor when needed.", [
        ("user", "I keep getting headaches in the afternoon. Any ideas?"),
        ("assistant", "Common causes are dehydration, skipped meals, too much caffeine or screen time, and "
                      "poor sleep. Drink water regularly and take breaks. If they are severe or new, see a "
                      "doctor."),
    ]),
    ("You are a friendly assistant.", [
        ("user", "Write a short poem about autumn."),
        ("assistant", "Leaves of copper drift and fall,\nthe evening comes before the call,\nthe air is "
                      "sharp with woodsmoke's breath,\nand gardens rest in quiet depth."),
        ("user", "Thanks! Now make it about spring."),
        ("assistant", "Green returns to every bough,\nthe blackbird sings, the furrowed plough\nturns up the "
                      "earth in morning light,\nand days grow long and nights grow slight."),
    ]),
    ("You are an assistant for a bank's customers.", [
        ("user", "How do I set up a standing order?"),
        ("assistant", "In the app, open Payments, choose New standing order, enter the recipient's name, "
                      "account number and sort code, the amount, the first payment date and how often it "
                      "repeats, then confirm with your passcode."),
    ]),
]

TRAIN_CHINESE = [
    "中国是世界上人口最多的国家之一，拥有悠久的历史和灿烂的文化。长城、故宫和兵马俑都是著名的名胜古迹，"
    "每年吸引成千上万的游客前来参观。",
    "学习一门新的语言需要时间和耐心。每天坚持练习听力和口语，多读书，多写作，慢慢地就会取得进步。"
    "不要害怕犯错误，错误是学习过程中很自然的一部分。",
    "春天来了，公园里的花都开了。孩子们在草地上放风筝，老人们在树下下棋，年轻人在湖边跑步。"
    "到处都是一片生机勃勃的景象。",
    "计算机科学是研究信息和计算的理论基础以及它们在计算机系统中实现和应用的学科。"
    "程序员使用编程语言编写软件，解决各种各样的实际问题。",
    "我的朋友住在上海，他在一家科技公司工作。周末的时候，他喜欢和家人一起去郊外爬山，"
    "或者在家里做饭、看电影。",
    "健康的生活方式包括均衡的饮食、适量的运动和充足的睡眠。医生建议成年人每天至少运动三十分钟，"
    "多吃蔬菜和水果，少吃油腻和过甜的食物。",
    "北京的冬天很冷，经常刮风，有时候还会下雪。夏天则比较热，雨水也比较多。"
    "秋天是北京最美的季节，天高气爽，香山的红叶非常漂亮。",
    "经济的发展离不开教育和科技的进步。许多城市正在建设新的地铁线路和高速铁路，"
    "让人们的出行变得更加方便快捷。",
]


# -- held-out test text written for this file (other topics, other system prompts) ---------------------------

TEST_CHATS = [
    ("You are a personal assistant. Keep answers short.", [
        ("user", "Remind me what time my dentist appointment is on Thursday."),
        ("assistant", "Your appointment with Dr. Moreau is on Thursday at 3:40 pm at the Riverside clinic."),
        ("user", "Can you move it to Friday morning?"),
        ("assistant", "I can ask the clinic. Would nine or ten o'clock suit you better?"),
    ]),
    ("You are a careful assistant for a law firm's staff.", [
        ("user", "Summarise the tenant's complaint in one sentence."),
        ("assistant", "The tenant says the landlord kept the deposit of 1,200 euros without listing any damage "
                      "and did not answer three letters asking for it back."),
    ]),
    ("You help people write emails.", [
        ("user", "Write a two-line email declining a job offer politely."),
        ("assistant", "Dear Ms. Okafor, thank you very much for the offer and for your time during the "
                      "interviews. After careful thought I have decided to accept another position, and I hope "
                      "our paths cross again."),
    ]),
    ("You are a gardening expert.", [
        ("user", "The leaves of my tomato plants are turning yellow from the bottom up. Why?"),
        ("assistant", "Usually it is a lack of nitrogen or uneven watering; sometimes it is early blight. "
                      "Remove the worst leaves, water deeply twice a week at the base, and feed with a "
                      "balanced fertiliser."),
        ("user", "Should I spray anything?"),
        ("assistant", "Only if you see brown spots with rings; then a copper fungicide helps. Otherwise "
                      "feeding and watering are enough."),
    ]),
    ("You are an assistant inside a phone's photo app.", [
        ("user", "Find the pictures from my sister's wedding in Porto last June."),
        ("assistant", "I found 214 photos taken in Porto between the 14th and 16th of June; 37 of them show "
                      "your sister. Shall I put them in a new album called Wedding?"),
    ]),
    ("You are a fitness coach.", [
        ("user", "I want to run my first 10 km race in eight weeks. How should I train?"),
        ("assistant", "Run three times a week: one easy run, one with short faster intervals and one long "
                      "slow run that grows by about a kilometre each week. Rest or walk on the other days, and "
                      "take the last week easier before the race."),
    ]),
]

TEST_CODE = [
    '''def merge_intervals(intervals):
    """Merge overlapping [start, end] pairs and return them sorted."""
    result = []
    for start, end in sorted(intervals):
        if result and start <= result[-1][1]:
            result[-1][1] = max(result[-1][1], end)
        else:
            result.append([start, end])
    return result


class LRUCache:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.items = {}

    def get(self, key):
        if key not in self.items:
            return None
        value = self.items.pop(key)
        self.items[key] = value
        return value

    def put(self, key, value):
        self.items.pop(key, None)
        if len(self.items) >= self.capacity:
            self.items.pop(next(iter(self.items)))
        self.items[key] = value
''',
    '''async function fetchUser(id) {
  const response = await fetch(`/api/users/${id}`, {
    headers: { Authorization: `Bearer ${localStorage.getItem("token")}` },
  });
  if (!response.ok) {
    throw new Error(`request failed: ${response.status}`);
  }
  const user = await response.json();
  return { name: user.name, email: user.email, joined: new Date(user.created_at) };
}
''',
    '''SELECT c.name, c.email, SUM(o.total) AS spent
FROM customers AS c
JOIN orders AS o ON o.customer_id = c.id
WHERE o.created_at >= DATE '2024-01-01'
GROUP BY c.name, c.email
HAVING SUM(o.total) > 500
ORDER BY spent DESC
LIMIT 20;
''',
    '''#!/usr/bin/env bash
set -euo pipefail
backup_dir="/var/backups/$(date +%Y-%m-%d)"
mkdir -p "$backup_dir"
for db in users billing analytics; do
  pg_dump --format=custom "$db" > "$backup_dir/$db.dump"
done
find /var/backups -maxdepth 1 -type d -mtime +14 -exec rm -rf {} +
''',
]

TEST_CHINESE = [
    "我明天上午十点要去医院复查，医生说上次的检查结果基本正常，但是还需要再验一次血。",
    "这个周末我们打算带孩子去杭州玩两天，住在西湖边的一家小旅馆，顺便看看外婆。",
    "请帮我把这份合同翻译成英文，客户希望在下周三之前收到，价格和付款方式不要改动。",
    "最近公司的销售额比去年同期增长了百分之十二，主要是因为新产品在南方市场卖得很好。",
    "我的银行卡好像丢了，我需要马上挂失，然后重新办一张新卡，请问需要带什么证件？",
    "妈妈让我下班以后顺路买一些牛奶、鸡蛋和青菜，晚上家里要来客人吃饭。",
    "老师说这次考试的成绩下周一公布，没有通过的同学可以在暑假参加补考。",
    "他在地铁上捡到一个钱包，里面有身份证和几张名片，就交给了车站的工作人员。",
]

TEST_PROSE = [
    "Hi Sam, just a quick note before the weekend. The plumber can only come on Tuesday between eight and "
    "noon, so could you leave the key with Mrs. Patel next door? I will be in Manchester for the conference "
    "until Wednesday night. The invoice from last month is still on the kitchen table; please pay it if you "
    "have a moment. Thanks, Alex.",
    "Patient notes: the patient, a 54-year-old teacher, reports shortness of breath when climbing stairs for "
    "about three weeks and mild swelling of both ankles in the evening. No chest pain. She takes medication "
    "for high blood pressure and stopped smoking ten years ago. Plan: blood tests, an ECG and a follow-up "
    "visit in one week.",
    "The committee met on the second floor of the old library. After a long discussion about the budget, they "
    "agreed to repair the roof before winter and to postpone the new reading room until next spring. Three "
    "members voted against the plan because they wanted more money spent on the children's section.",
    "Our hike started early in the morning at the foot of the mountain. The trail climbed through a pine "
    "forest, crossed two wooden bridges and ended at a small lake, still and cold, where we ate our "
    "sandwiches and watched the clouds gather over the ridge before heading back down.",
    "Dear landlord, the heating in flat 4B has not worked since Sunday and the nights are getting cold. My "
    "daughter has a fever and we cannot keep the bedroom warm. Could someone come tomorrow? I work from home, "
    "so any time after ten is fine. Kind regards, Maria Lindqvist.",
    "I have been thinking about leaving my job. The pay is fine, but my manager keeps changing the plan every "
    "week and I have not had a proper weekend since March. My partner says I should talk to HR first, but I "
    "am worried it will only make things worse.",
]


# -- numbers: records from a seeded generator (the training and test corpora use different seeds) ------------

def number_records(seed: int, count: int) -> list[str]:
    """``count`` number-heavy records (invoices, phone numbers, dates, coordinates, card-like numbers)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        kind = rng.randrange(5)
        if kind == 0:
            qty, price = rng.randint(1, 20), rng.randint(99, 99999) / 100
            out.append(f"Invoice {rng.randint(1000, 9999)}-{rng.randint(10, 99)}: {qty} x {price:.2f} = "
                       f"{qty * price:.2f} EUR, due {rng.randint(2020, 2026)}-{rng.randint(1, 12):02d}-"
                       f"{rng.randint(1, 28):02d}.")
        elif kind == 1:
            out.append(f"Call +{rng.randint(1, 99)} {rng.randint(100, 999)} {rng.randint(100, 999)} "
                       f"{rng.randint(1000, 9999)} after {rng.randint(8, 18)}:{rng.choice(['00', '15', '30', '45'])}.")
        elif kind == 2:
            out.append(f"Location {rng.uniform(-90, 90):.5f}, {rng.uniform(-180, 180):.5f}, altitude "
                       f"{rng.randint(0, 4000)} m.")
        elif kind == 3:
            out.append("Card " + " ".join(f"{rng.randint(0, 9999):04d}" for _ in range(4)) +
                       f", expires {rng.randint(1, 12):02d}/{rng.randint(25, 32)}.")
        else:
            a, b = rng.randint(10, 9999), rng.randint(10, 999)
            out.append(f"{a} * {b} = {a * b}; {a} + {b} = {a + b}.")
    return out


# -- assembly -------------------------------------------------------------------------------------------------

def _chat(tokenizer, system: str, turns) -> str:
    messages = [{"role": "system", "content": system}] + [{"role": r, "content": c} for r, c in turns]
    return tokenizer.apply_chat_template(messages, tokenize=False)


def _group(records: list[str], size: int) -> list[str]:
    return [" ".join(records[i:i + size]) for i in range(0, len(records), size)]


def stdlib_code() -> list[str]:
    """The first ``STDLIB_CHARS`` characters of each module in ``STDLIB_MODULES``."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for name in STDLIB_MODULES:
        path = lib / name
        if not path.is_file():
            raise FileNotFoundError(f"training corpus: {path} not found (the stdlib of this interpreter)")
        out.append(path.read_text()[:STDLIB_CHARS])
    return out


def training_corpus(tokenizer) -> list[Document]:
    """The attacker's text, several kinds (see the module docstring)."""
    docs = [Document("prose", (ROOT / "partition_tools" / "data" / "sample.txt").read_text())]
    docs += [Document("code", t) for t in stdlib_code()]
    docs += [Document("chat", _chat(tokenizer, s, turns)) for s, turns in TRAIN_CHATS]
    docs += [Document("chinese", t) for t in TRAIN_CHINESE]
    docs += [Document("numbers", t) for t in _group(number_records(seed=1, count=60), 6)]
    return docs


def test_corpus(tokenizer) -> list[Document]:
    """The held-out text the attack is judged on."""
    docs = [Document("chat", _chat(tokenizer, s, turns)) for s, turns in TEST_CHATS]
    docs += [Document("code", t) for t in TEST_CODE]
    docs += [Document("chinese", t) for t in TEST_CHINESE]
    docs += [Document("numbers", t) for t in _group(number_records(seed=2, count=15), 5)]
    docs += [Document("prose", t) for t in TEST_PROSE]
    return docs


def check_disjoint(train: list[Document], test: list[Document], span: int = 40) -> None:
    """Raise ``ValueError`` if a ``span``-character piece of a test document, taken every ``span // 2``
    characters (pieces with chat-template markup skipped), occurs in the training text."""
    haystack = "\n".join(d.text for d in train)
    for d in test:
        body = d.text
        for i in range(0, max(1, len(body) - span), span // 2):
            piece = body[i:i + span]
            if "<|im_" in piece or len(piece) < span:
                continue
            if piece in haystack:
                raise ValueError(f"test {d.kind} text occurs in the training corpus: {piece!r}")
