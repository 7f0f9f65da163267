"""Sequence-level fidelity of edge graphs: are greedy chat answers of the split identical to the unsplit model's?

SmolLM2 split at N (default 8); chat prompts rendered by the bundle's chat template; the reference is the unsplit
fp32 model's greedy answer of up to ``--new`` tokens (transformers ``generate``). Two modes:

* ``--mode served`` (default), the path users run: per edge arm a bundle (the fp32 bundle with that arm's edge
  graph: same cloud half, same bundle id) behind its own ``autoglm-cloud serve`` on loopback, and per codec arm
  a fresh :class:`edge_client.client.EdgeClient` asking each prompt greedily (``complete``), the cloud computing
  in fp32 (the CPU server's variant);
* ``--mode teacher``, offline screening: the prompt plus the reference answer go once through the edge graph
  (``FrontRuntime``), the boundary through the codec(s) per token row, and the fp32 cloud half
  (``CloudModel``); the split's greedy answer equals the reference up to the first position whose argmax
  differs, so one forward per prompt gives both measures exactly (every op treats tokens independently of
  batching: per-token activation quantization, per-row codecs). Cheap enough to screen many arms.

Prompt sets: ``HELD_OUT`` (60 everyday questions: the evaluation, seen by no calibration and no tuning),
``TUNING`` (80 others, disjoint: for choosing among arms, ``--prompt-set tuning``), ``FRESH`` / ``FRESH2`` (60
each, written in session 8 after the choices they judge: ``--prompt-set fresh`` / ``fresh2``), ``FRESH3`` (60,
written in session 20 in other styles, after every choice: ``--prompt-set fresh3``) and ``FRESH4`` (60, written
after FRESH3's run and unlike all of them: Chinese, phone-agent instructions, long app / UI system prompts, code,
JSON, multi-turn chats, one-word messages: ``--prompt-set fresh4``). A set's item is one user message (a str) or
a whole message list as (role, content) pairs. All six are checked disjoint at start. The recipes calibrate on
the last 512 tokens of ``partition_tools/data/sample.txt``, prose that is in no set.

Codec arms: ``policy`` (served only: the precision policy's choice per message, what users get by default), a
codec name (every message in it), or ``PROMPT/STEP`` (teacher only: prompt rows in PROMPT, answer rows - the
decode steps - in STEP, e.g. ``int8-outlier/fp16``).

Per arm and codec: identical answers (share and count), tokens before the first divergence (share of reference
tokens and mean per answer), the diverging prompts; served also bytes up per answer and the codecs used.

Usage::

    python bench/edge_answers_bench.py --arms fp32,int8 --codecs fp16,policy --json docs/results/edge_answers.json
    python bench/edge_answers_bench.py --mode teacher --prompt-set tuning --arms int8,int8-down-acc1 \\
        --codecs fp16,int8-outlier/fp16        # screening
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch

from split_bundles import cached_split, choices, common_args, variant_bundle

Prompt = str | tuple[tuple[str, str], ...]  # one user message, or the whole message list as (role, content) pairs

HELD_OUT = [
    "What is the boiling point of water at sea level?", "Give me three tips for learning a new language.",
    "Explain what a black hole is to a ten-year-old.", "Write a short poem about autumn leaves.",
    "How do vaccines work?", "What are the main causes of climate change?",
    "Suggest a healthy breakfast idea.", "What is the difference between weather and climate?",
    "How many continents are there, and what are they?", "Explain the rules of chess briefly.",
    "Why do cats purr?", "What is machine learning?", "Describe the water cycle.",
    "Give me a recipe for a simple tomato soup.", "What is the tallest mountain in the world?",
    "How can I improve my handwriting?", "Write a two-sentence horror story.",
    "What does a CPU do in a computer?", "List four renewable energy sources.",
    "Why is exercise good for the brain?", "Translate 'good morning' into Spanish and French.",
    "What is the Pythagorean theorem?", "How do bees make honey?", "Explain inflation in simple terms.",
    "What should I pack for a weekend camping trip?", "Who wrote Romeo and Juliet?",
    "How does a rainbow form?", "Give me a motivational quote and explain it.",
    "What is the speed of light?", "How do I make a paper airplane?", "What are prime numbers?",
    "Describe the taste of a lemon.", "Why do leaves change color in the fall?",
    "What is the capital of Japan, and what is it known for?", "How can I save money on groceries?",
    "Explain what DNA is.", "Write a limerick about a cat.", "What is the difference between a virus and a bacterium?",
    "How does the internet work, in short?", "What are the benefits of reading books?",
    "Name three famous painters and one work by each.", "How do airplanes stay in the air?",
    "What is a haiku? Give an example.", "How do I start a vegetable garden?", "What causes earthquakes?",
    "Explain the greenhouse effect.", "Suggest a fun activity for a rainy day.", "What is 15 percent of 80?",
    "Why is the ocean salty?", "How do I apologize to a friend?", "What are the planets of the solar system?",
    "Describe a good morning routine.", "What is photosynthesis used for by plants?",
    "How do magnets work?", "Give me a tongue twister.", "What is a noun? Give examples.",
    "How do I calm down before an exam?", "What is the largest animal on Earth?",
    "Explain why we have seasons.", "Write a thank-you note to a teacher.",
]

TUNING = [  # for choosing among arms; disjoint from HELD_OUT (checked at start)
    "What is the freezing point of water in Fahrenheit?", "Give me two tips for a job interview.",
    "Explain how a refrigerator keeps food cold.", "Write a short poem about the moon.",
    "How do antibiotics work?", "What are the main causes of air pollution?",
    "Suggest a quick lunch for a busy day.", "What is the difference between a lake and a pond?",
    "How many bones are in the human body?", "Explain the rules of soccer briefly.",
    "Why do dogs wag their tails?", "What is a neural network?", "Describe how a volcano erupts.",
    "Give me a recipe for pancakes.", "What is the longest river in the world?",
    "How can I sleep better at night?", "Write a two-sentence science fiction story.",
    "What does RAM do in a computer?", "List three kinds of clouds.", "Why is drinking water important?",
    "Translate 'thank you' into German and Italian.", "What is the area of a circle?",
    "How do birds migrate?", "Explain supply and demand in simple terms.",
    "What should I bring to a picnic?", "Who painted the Mona Lisa?", "How does thunder happen?",
    "Give me a proverb and explain it.", "What is the speed of sound?", "How do I tie a tie?",
    "What are even numbers?", "Describe the smell of fresh bread.", "Why does ice float on water?",
    "What is the capital of Italy, and what is it famous for?", "How can I stay focused while studying?",
    "Explain what an atom is.", "Write a riddle about a clock.", "What is the difference between a frog and a toad?",
    "How does a compass work?", "What are the benefits of learning music?",
    "What is the boiling point of milk?", "Give me three ideas for a birthday gift.",
    "Explain how a bicycle gear works.", "Write a short poem about the rain.", "How do plants drink water?",
    "What are the main causes of traffic jams?", "Suggest a dinner idea with rice.",
    "What is the difference between a hill and a mountain?", "How many players are on a basketball team?",
    "Explain the rules of tennis briefly.", "Why do owls hunt at night?", "What is a computer program?",
    "Describe how a seed grows into a plant.", "Give me a recipe for lemonade.",
    "What is the deepest ocean on Earth?", "How can I make friends in a new city?",
    "Write a two-sentence fairy tale.", "What does a keyboard do?", "List three types of triangles.",
    "Why is sleep important for children?", "Translate 'see you later' into French.",
    "What is a fraction?", "How do fish breathe underwater?", "Explain interest on a savings account.",
    "What should I do on a long train ride?", "Who invented the telephone?", "How does snow form?",
    "Give me a short joke about computers.", "What is the temperature of the sun?",
    "How do I plant a tree?", "What are odd numbers?", "Describe the sound of the ocean.",
    "Why do we have day and night?", "What is the capital of Spain?", "How can I be more patient?",
    "Explain what a cell is in biology.", "Write a riddle about the wind.",
    "What is the difference between a lion and a tiger?", "How does a lighthouse help ships?",
    "What are the benefits of walking every day?",
]
FRESH = [  # written in session 8 after every recipe choice so far: judged once per recipe, never tuned on
    "What does a thermometer measure?", "Give me three ways to reduce stress at work.",
    "Explain how a microwave oven heats food.", "Write a short poem about a city at night.",
    "How do solar panels make electricity?", "What are the main causes of deforestation?",
    "Suggest a snack that is high in protein.", "What is the difference between a sea and an ocean?",
    "How many hours are in a week?", "Explain the rules of volleyball briefly.",
    "Why do bats hang upside down?", "What is cloud computing?", "Describe how a glacier moves.",
    "Give me a recipe for guacamole.", "What is the largest desert in the world?",
    "How can I remember names better?", "Write a two-sentence mystery story.",
    "What does a graphics card do?", "List three musical instruments with strings.",
    "Why is breakfast called the most important meal?", "Translate 'good night' into Italian.",
    "What is the volume of a cube?", "How do spiders spin webs?", "Explain what a budget is in simple terms.",
    "What should I wear to a job interview?", "Who discovered penicillin?", "How does fog form?",
    "Give me a famous saying about time and explain it.", "What is the population of the Earth, roughly?",
    "How do I boil an egg?", "What is a square number?", "Describe the feeling of sand between your toes.",
    "Why do we yawn?", "What is the capital of Canada?", "How can I drink more water during the day?",
    "Explain what an electron is.", "Write a riddle about a candle.",
    "What is the difference between a crocodile and an alligator?", "How does a battery store energy?",
    "What are the benefits of drawing?", "Name three famous scientists and what they are known for.",
    "How do submarines dive and surface?", "What is a sonnet?", "How do I take care of a houseplant?",
    "What causes tides in the ocean?", "Explain how recycling helps the environment.",
    "Suggest a game to play with a group of friends.", "What is 25 percent of 200?",
    "Why is the sky dark at night?", "How do I say no politely?", "What are the colors of the rainbow?",
    "Describe a relaxing evening routine.", "What do roots do for a plant?", "How do elevators work?",
    "Give me a fun fact about octopuses.", "What is a verb? Give examples.",
    "How do I prepare for a long hike?", "What is the fastest land animal?",
    "Explain why the moon has phases.", "Write a short birthday message for a grandmother.",
]
FRESH2 = [  # written in session 8 after the prompt codec's rule was chosen on TUNING: the judge of that rule
    "What does a barometer tell you?", "Give me three tips for writing a good email.",
    "Explain how a dishwasher cleans dishes.", "Write a short poem about the first snow.",
    "How do wind turbines generate power?", "What are the main causes of soil erosion?",
    "Suggest a vegetarian dinner for two.", "What is the difference between a town and a city?",
    "How many minutes are in a day?", "Explain the rules of badminton briefly.",
    "Why do giraffes have long necks?", "What is a database?", "Describe how a river forms a delta.",
    "Give me a recipe for banana bread.", "What is the coldest place on Earth?",
    "How can I stop procrastinating?", "Write a two-sentence adventure story.",
    "What does a router do in a home network?", "List three kinds of bridges.",
    "Why is it important to wash your hands?", "Translate 'how are you' into German.",
    "What is the perimeter of a rectangle?", "How do ants find food?", "Explain what a loan is in simple terms.",
    "What should I pack for a beach holiday?", "Who was the first person to walk on the moon?",
    "How does hail form?", "Give me a saying about friendship and explain it.", "How far is the moon from the Earth?",
    "How do I make a cup of tea?", "What is a multiple of a number?", "Describe the smell of rain on dry ground.",
    "Why do we get goosebumps?", "What is the capital of Australia?", "How can I keep my room tidy?",
    "Explain what a molecule is.", "Write a riddle about a shadow.",
    "What is the difference between a rabbit and a hare?", "How does a thermostat work?",
    "What are the benefits of learning a second language?", "Name three famous composers and one piece by each.",
    "How do hot air balloons fly?", "What is a fable?", "How do I care for a pet goldfish?",
    "What causes thunderstorms?", "Explain why bees are important for farming.",
    "Suggest a hobby that costs little money.", "What is 10 percent of 350?",
    "Why do stars twinkle?", "How do I ask my boss for a day off?", "What are the three states of matter?",
    "Describe a perfect picnic day.", "What do leaves do for a tree?", "How do escalators work?",
    "Give me a fun fact about penguins.", "What is an adjective? Give examples.",
    "How do I get ready for a marathon?", "What is the smallest planet in the solar system?",
    "Explain why we see lightning before we hear thunder.", "Write a short get-well message for a friend.",
]
FRESH3 = [  # written in session 20, after every recipe, codec and policy choice: judged once, never tuned on; other
    # styles than the earlier sets (constraints, rewrites, code, phone-agent steps, small sums, longer prompts)
    "Rewrite this sentence to sound more polite: Send me the report now.",
    "In one sentence, what is the job of a lighthouse keeper?",
    "Write a Python function that returns the largest of three numbers.",
    "I am on my phone's home screen and want to set an alarm for 7 am. What steps should I take?",
    "A shop sells pens at 3 dollars each. How much do 7 pens cost?",
    "Summarize the story of Cinderella in three sentences.",
    "What is the opposite of 'generous'? Use both words in a sentence.",
    "Write a haiku about a busy train station.",
    "My laptop battery drains fast. List some likely reasons.",
    "Explain the difference between RAM and storage using a kitchen analogy.",
    "Turn this list into a sentence: apples, bread, milk, eggs.",
    "What are two pros and two cons of working from home?",
    "Write a short text message inviting a neighbour to a barbecue on Saturday.",
    "How do I turn on airplane mode on a smartphone?",
    "If a train leaves at 2:15 pm and the trip takes 95 minutes, when does it arrive?",
    "Describe the colour blue to someone who cannot see.",
    "Write a SQL query that counts the rows in a table named orders.",
    "Give a one-paragraph explanation of why the sky looks red at sunset.",
    "What questions should I ask when viewing an apartment to rent?",
    "Correct the grammar: She don't like going to school on mondays.",
    "Plan a simple three-day workout schedule for a beginner.",
    "What is a haiku, and how many syllables does each line have?",
    "Open the settings app and find the battery usage screen: describe each tap.",
    "Why does bread go stale?",
    "Write a limerick about a forgetful cat.",
    "What is compound interest? Give a small numeric example.",
    "Name five fruits that are high in vitamin C.",
    "Explain what an API is to a shop owner.",
    "How should I store fresh herbs so they last longer?",
    "Write a polite reply declining a meeting invitation.",
    "What happens to our bodies when we sleep?",
    "Give me a short motivational quote and say who might have said it.",
    "How do I search for a contact and start a video call on a phone?",
    "What is the main idea of recycling?",
    "Write a JavaScript snippet that prints the numbers 1 to 5.",
    "What is 15 multiplied by 12?",
    "Describe a sunrise over the sea in two sentences.",
    "What are the steps to change a flat bicycle tyre?",
    "Explain the word 'photosynthesis' by splitting it into its parts.",
    "Suggest three names for a small bakery.",
    "How can I make my phone's text larger?",
    "Why do some animals hibernate in winter?",
    "Write a four-line poem that rhymes, about coffee.",
    "Is a tomato a fruit or a vegetable? Explain briefly.",
    "Give me a packing checklist for a two-day business trip.",
    "Explain what a password manager does and why it helps.",
    "What does the idiom 'break the ice' mean?",
    "A recipe needs 250 grams of flour for 10 cookies. How much flour for 30 cookies?",
    "Write an opening line for a mystery novel.",
    "How do noise-cancelling headphones work?",
    "List the planets in order from the Sun.",
    "What should I do if I lock myself out of my house?",
    "Explain to a child why we should not touch a hot stove.",
    "Write a short product description for a reusable water bottle.",
    "How do I take a screenshot on an Android phone?",
    "What makes a good team leader?",
    "Convert 5 kilometres to miles, roughly.",
    "Describe how to fold a paper airplane.",
    "What is the purpose of a museum?",
    "Write a thank-you note to a teacher at the end of the school year.",
]
# FRESH4's long system prompts: app / UI descriptions (371-436 tokens each), two questions each
SYS_ROUTEMATE = (
    "You are the built-in help assistant of RouteMate, a navigation app for Android phones. Answer the user's "
    "question about the app in a few short numbered steps, naming the exact buttons and screens described below. "
    "Do not invent features that are not listed here.\n"
    "Screens and controls:\n"
    "1. Map screen (opens at start). A full-screen map with the user's position as a blue dot. At the top, a "
    "search bar that reads 'Where to?'. On the right edge, three round buttons stacked vertically: Layers (a "
    "square stack icon), Compass (turns the map back to north) and My Location (a target icon). At the bottom, "
    "a tab bar with four tabs: Explore, Go, Saved and Profile.\n"
    "2. Search results. Typing in the search bar shows a list of places; each row has the place name, the "
    "distance and a small arrow. Tapping a row opens the Place card.\n"
    "3. Place card. A sheet that slides up from the bottom with the place name, address, opening hours and "
    "photos. Buttons on the card: Directions (blue), Start, Save (a bookmark icon) and Share.\n"
    "4. Route preview. After Directions, the map shows up to three routes in grey with the fastest one in blue. "
    "A row of travel modes sits at the top: car, public transport, walking and bicycle. The three-dot menu in "
    "the top right corner opens Route options.\n"
    "5. Route options. Switches: Avoid tolls, Avoid motorways and Avoid ferries. A Done button closes the sheet "
    "and recalculates the route.\n"
    "6. Saved tab. Lists Home, Work and Favourites. An 'Add place' button at the bottom opens the search bar; "
    "after choosing a place the app asks for a label: Home, Work or Favourite.\n"
    "7. Profile tab. Settings, Offline maps, Voice guidance volume, Units (kilometres or miles) and Sign out.\n"
    "Keep every answer under six steps. If something cannot be done in RouteMate, say so plainly."
)
SYS_POCKETBANK = (
    "You are Penny, the assistant inside the PocketBank mobile banking app. You can only explain how to use the "
    "app; you cannot see the user's balance or move money yourself. Never ask for a PIN, a password or a full "
    "card number. Reply in short, friendly sentences and refer to the screens by the names below.\n"
    "App layout:\n"
    "- Home: the balance of each account (Everyday, Savings) in large cards. Under the cards, a row of quick "
    "actions: Send, Request, Top up and Pay bills. Below that, the five most recent transactions.\n"
    "- Bottom navigation bar: Home, Cards, Payments, Insights and More.\n"
    "- Cards: a picture of each card. Tapping a card shows its settings: Freeze card (a switch with a snowflake "
    "icon), Show PIN, Spending limit, Online payments (a switch) and Report lost or stolen (red text at the "
    "bottom). A frozen card can be unfrozen at any time with the same switch.\n"
    "- Payments: Scheduled payments, Direct debits, Saved payees and a plus button to add a new payee. Adding a "
    "payee needs the name, the sort code and the account number, then a confirmation code sent by text.\n"
    "- Insights: spending by category (Groceries, Transport, Eating out, Bills, Shopping, Other) shown as a "
    "ring chart for the current month. Arrows at the top switch to earlier months. Tapping a category lists "
    "its transactions.\n"
    "- More: Statements (PDF per month), Profile and address, Notifications, Security (face unlock, change "
    "passcode), Help centre and Log out.\n"
    "If the user reports fraud or a stolen phone, tell them to call the number on the back of their card first, "
    "then explain the steps in the app."
)
SYS_QUICKBITE = (
    "You are the support chat of QuickBite, a food delivery app. Help customers with orders, payments and "
    "their account using only the features described here. Be polite and brief, and give steps the customer "
    "can follow on their own phone.\n"
    "Home screen: a delivery address line at the very top (tap it to change or add an address), a search field "
    "'Restaurants or dishes', category chips (Pizza, Noodles, Burgers, Healthy, Desserts, Groceries) and a "
    "scrolling list of restaurants with rating, delivery time and delivery fee.\n"
    "Restaurant page: the menu grouped by section, each dish with a plus button. The basket bar at the bottom "
    "shows the item count and the total; tapping it opens Checkout.\n"
    "Checkout: delivery address, delivery time (As soon as possible or Schedule), payment method (card, wallet "
    "balance or cash on delivery), a promo code field and the Place order button.\n"
    "Orders tab: current orders with a live map of the rider, and past orders. Each past order has the "
    "buttons Reorder, Rate and Get help.\n"
    "Get help: a list of problems - Missing items, Wrong items, Food arrived cold or damaged, Order never "
    "arrived, Charged twice. Choosing one asks for a photo when it makes sense and offers a refund to the "
    "wallet (instant) or to the card (three to five working days).\n"
    "Account tab: Addresses (a list with Add new address at the bottom; each address has a label such as Home, "
    "Work or Other, and notes for the rider), Payment methods, Wallet, Notifications, Language and Log out.\n"
    "Refunds for problems reported more than 48 hours after delivery are not possible. Do not promise anything "
    "that this description does not allow."
)
SYS_SNAPSHELF = (
    "You are the help assistant of SnapShelf, the photo gallery app that comes with the phone. The user asks "
    "how to do something in the app; answer with the exact path through the screens below, one step per line. "
    "If the app cannot do it, say so and suggest the closest feature.\n"
    "Tabs along the bottom: Photos, Albums, Search and Shared.\n"
    "Photos tab: every photo and video as a grid, newest at the bottom, grouped by day. Pinching zooms between "
    "day, month and year views. A long press on a photo starts selection mode: small circles appear on each "
    "item, and a toolbar at the bottom offers Share, Add to album, Favourite, Hide and Delete.\n"
    "Single photo view: swipe left or right to move between photos. The top bar has Back, Info (shows the "
    "date, the place and the camera settings) and a three-dot menu with Set as wallpaper, Copy, Rotate and "
    "Slideshow. The bottom bar has Share, Edit, Favourite (a heart) and Delete.\n"
    "Edit: Crop and rotate, Filters (twelve presets), Adjust (brightness, contrast, warmth, sharpness) and "
    "Markup (draw or add text). Save keeps a copy; Revert goes back to the original at any time.\n"
    "Albums tab: the user's albums, then Favourites, Videos, Screenshots, Hidden and Recently deleted. The New "
    "album button is in the top right corner; a new album asks for a name and then for photos to add. Items "
    "stay in Recently deleted for 30 days, where they can be restored or removed for good.\n"
    "Shared tab: shared albums. Open an album and tap Invite to add people by phone number or email; they can "
    "see, comment on and add photos. A link can also be created with Copy link.\n"
    "Search tab: search by place, date, person or thing (for example 'beach' or 'dog')."
)

FRESH4 = [  # written after every recipe, codec and policy choice so far (after FRESH3): judged once, never tuned on.
    # Unlike the earlier sets (one short English user turn each): Chinese, phone-agent instructions, long app / UI
    # system prompts, code, sums, lists, JSON answers, multi-turn chats and very short messages. An item is
    # one user message (a str) or the whole message list as (role, content) pairs.
    # Chinese
    "帮我写一条请假的微信消息，明天上午要去看牙医。",
    "用三句话介绍一下长江。",
    "怎样在手机上把屏幕亮度调低？",
    "给我推荐三道简单的家常菜。",
    "请把这句话翻译成英文：今天天气很好，我们去公园散步吧。",
    "一个苹果三块钱，买五个苹果一共多少钱？",
    "写一首关于早晨菜市场的四行小诗。",
    "什么是人工智能？请用简单的话解释。",
    "周末在家可以做哪些放松的事情？",
    "帮我给房东发一条消息，说厨房的水龙头漏水了，请他这周来修。",
    # phone-agent instructions
    "Open Settings and turn on Bluetooth, then tell me the steps you took.",
    "Open the Camera app, switch to the front camera and take a photo. List each tap.",
    "Go to the Messages app and delete the conversation with 'Delivery Updates'. Describe what you tap, step by step.",
    "Open the Calendar and add an event called 'Dentist' next Tuesday at 3 pm. What are the steps?",
    "Turn on Do Not Disturb until 8 am tomorrow and tell me how you did it.",
    "Open the app store, search for a weather app and install the first result. Give the steps as a numbered list.",
    "Lower the screen brightness and turn on dark mode from the quick settings panel. Explain each swipe and tap.",
    "Share my current location with Li Wei in WeChat. What would you do on the phone, step by step?",
    # long system prompts (app / UI descriptions)
    (("system", SYS_ROUTEMATE), ("user", "How do I avoid toll roads on my route?")),
    (("system", SYS_ROUTEMATE),
     ("user", "I want to save my office so I can get there quickly. Which buttons do I press?")),
    (("system", SYS_POCKETBANK), ("user", "I think I left my card in a taxi. How do I freeze it?")),
    (("system", SYS_POCKETBANK), ("user", "Where can I see how much I spent on eating out last month?")),
    (("system", SYS_QUICKBITE), ("user", "My noodles arrived cold an hour ago. Can I get my money back?")),
    (("system", SYS_QUICKBITE), ("user", "How do I add my parents' flat as a second delivery address?")),
    (("system", SYS_SNAPSHELF), ("user", "How do I make an album of my holiday photos and share it with my sister?")),
    (("system", SYS_SNAPSHELF), ("user", "I deleted a picture of my dog yesterday by mistake. Can I get it back?")),
    # code
    "Write a Python function that checks whether a string is a palindrome.",
    "What does this code print?\n\nfor i in range(3):\n    print(i * 2)",
    "Write a bash command that counts the lines of every .txt file in the current folder.",
    "Fix the bug in this function:\n\ndef add(a, b):\n    return a - b",
    "Write a regular expression that matches a five-digit postal code.",
    "Write a C function that swaps two integers using pointers.",
    # arithmetic
    "What is 17 + 28?",
    "Compute 144 divided by 12, then add 9.",
    "I earn 3,200 a month and spend 2,450. How much do I save in a year?",
    "What is 7 squared minus 3 cubed?",
    "A car travels 180 km in 2.5 hours. What is its average speed?",
    # lists
    "List five things to check before a long car journey.",
    "Give me a bulleted list of four Python data types.",
    "List the days of the week in reverse order.",
    "Name six countries in South America, one per line.",
    # JSON answers
    "Return a JSON object with the fields name, age and city for a made-up person.",
    "Extract the date and the amount from this text as JSON: 'Paid 42.50 euros for groceries on 3 May 2024.'",
    "Give me three book recommendations as a JSON array of objects with title and author.",
    "Convert this to JSON: temperature 21 degrees, humidity 60 percent, wind 12 km/h.",
    "Reply only with JSON: is 29 a prime number? Use the keys number and is_prime.",
    # multi-turn (an earlier assistant turn included)
    (("user", "What is the capital of Portugal?"), ("assistant", "The capital of Portugal is Lisbon."),
     ("user", "Which river runs through it?")),
    (("user", "Suggest a name for my new puppy."),
     ("assistant", "How about Biscuit? It is short, friendly and easy to call out."),
     ("user", "Give me two more options that start with M.")),
    (("user", "I want to bake cookies but I have no eggs."),
     ("assistant", "You can replace each egg with three tablespoons of mashed banana or apple sauce."),
     ("user", "Will that change the taste much?")),
    (("user", "Convert 3 hours to minutes."), ("assistant", "3 hours is 180 minutes."),
     ("user", "And how many seconds is that?")),
    (("user", "Write a one-line slogan for a bike shop."), ("assistant", "Ride further, smile wider."),
     ("user", "Make it funnier.")),
    (("user", "我想学做饭，从哪里开始比较好？"),
     ("assistant", "可以先从简单的菜开始，比如番茄炒蛋和清炒青菜。"),
     ("user", "番茄炒蛋要怎么做？")),
    # very short
    "hi",
    "?",
    "ok",
    "thanks!",
    "2+2",
    "help",
    # a short system prompt, and a summary
    (("system", "You are a pirate. Answer every question like one."), ("user", "Describe your ship.")),
    "Summarize in one sentence: The meeting was moved from Monday to Wednesday because the manager is travelling, "
    "and the agenda stays the same.",
]
PROMPT_SETS = {"held-out": HELD_OUT, "tuning": TUNING, "fresh": FRESH, "fresh2": FRESH2, "fresh3": FRESH3,
               "fresh4": FRESH4}

I8 = {"mode": "int8", "block_size": 32, "accuracy_level": 4, "embedding": "int8", "smooth_alpha": 0.5}
DOWN = ["layers.*.mlp.down_proj"]
PF = {"prefill": "fp32"}  # precision by phase: the prompt through an fp32 graph, decode steps quantized
RECIPE = "recipe"
ROUNDED = "rounded"  # recipe_for with the rounded recipe's settings (a source on no grid gets it by default)
ROUNDED_SETTINGS = {"smooth_alpha": 0.5, "source_grid": None, "outlier_channels": 0}
GRID = {"base": RECIPE, "smooth_alpha": None, "source_grid": "offset", "outlier_channels": 0}
PARTS = (("qkv", "self_attn.qkv_proj"), ("o", "self_attn.o_proj"), ("gate_up", "mlp.gate_up_proj"),
         ("down", "mlp.down_proj"))
# arm -> (manifest edge_quant, quantize_front kwargs on the fused fp32 graph); None: the fp32 graph itself;
# "recipe": recipe_for(mode) - the shipped default of `autoglm-partition split --edge-quant mode`; a dict with
# "base": "recipe": that default with the dict's other keys changed
ARMS: dict[str, tuple[str, dict | str | None]] = {
    "fp32": ("fp32", None),
    "int8": ("int8", RECIPE),
    "int8-pf32": ("int8", {"base": ROUNDED, **PF}),  # the default + precision by phase (split --fp32-prefill)
    "int8-pf32-gptq": ("int8", {"base": ROUNDED, **PF, "gptq": True}),  # + GPTQ rounding of the int8 weights
    "int8-gptq": ("int8", {"base": ROUNDED, "gptq": True}),
    "int8-prev": ("int8", I8),  # the default recipe before the fp32 down_proj (float_outliers=2)
    "int8-prev-pf32": ("int8", {**I8, **PF}),  # no fp32 down_proj, fp32 prompt
    "int4": ("int4", RECIPE),
    "int4-pf32": ("int4", {"base": RECIPE, **PF}),
    "int8-kv8": ("int8", {**I8, "kv_cache": "int8"}),
    # `split --edge-kv int8` on the default int4 front of a grid source, and on the fp32 front
    "int4-kv8": ("int4", {"base": RECIPE, "kv_cache": "int8"}),
    "fp32-kv8": ("fp32", {"mode": "fp32", "kv_cache": "int8"}),
    "int8-nosmooth": ("int8", {**I8, "smooth_alpha": None}),
    "int8-acc1": ("int8", {**I8, "accuracy_level": 1}),
    "int8-acc1-nosmooth": ("int8", {**I8, "accuracy_level": 1, "smooth_alpha": None}),
    "int8-acc1-nosmooth-asym": ("int8", {**I8, "accuracy_level": 1, "smooth_alpha": None, "symmetric": False}),
    "int8-asym": ("int8", {**I8, "symmetric": False}),
    "int8-b16": ("int8", {**I8, "block_size": 16}),
    "int8-b128": ("int8", {**I8, "block_size": 128}),
    "int8-qkv-fp32": ("int8", {**I8, "keep_float": ["layers.*.self_attn.qkv_proj"]}),
    "int8-o-fp32": ("int8", {**I8, "keep_float": ["layers.*.self_attn.o_proj"]}),
    "int8-gate_up-fp32": ("int8", {**I8, "keep_float": ["layers.*.mlp.gate_up_proj"]}),
    "int8-down-fp32": ("int8", {**I8, "keep_float": DOWN}),
    "int8-down-acc1": ("int8", {**I8, "precise": DOWN}),
    "int8-down12-fp32": ("int8", {**I8, "keep_float": ["layers.1.mlp.down_proj", "layers.2.mlp.down_proj"]}),
    "int8-down-top2": ("int8", {**I8, "float_outliers": 2}),  # the same two, chosen by calibration
    "int8-down-top3": ("int8", {**I8, "float_outliers": 3}),
    "int8-had-down": ("int8", {**I8, "rotate": DOWN}),
    "int8-had-all": ("int8", {**I8, "rotate": ["layers.*"]}),
    "int8-had-all-kv8": ("int8", {**I8, "rotate": ["layers.*"], "kv_cache": "int8"}),
    "int8-layer0-fp32": ("int8", {**I8, "keep_float": ["layers.0.*"]}),
    "int8-layer7-fp32": ("int8", {**I8, "keep_float": ["layers.7.*"]}),
    "int8-rtn": ("int8", {"base": ROUNDED}),  # the rounded recipe (the int8 default before the source grid)
    # the checkpoint's own 4-bit grid kept in the 8-bit codes (partition_tools.source_grid), no smoothing (per-
    # channel scales would move the weights off their grid), and k outlier channels (partition_tools.
    # outlier_channels); int8-grid-oc16 is the default recipe for a grid source
    "int8-grid": ("int8", GRID),
    "int8-grid-exact": ("int8", {**GRID, "source_grid": "exact"}),  # + the offsets' residual in fp32
    "int8-grid-acc1": ("int8", {**GRID, "source_grid": "exact", "accuracy_level": 1}),  # fp32 activations
    "int8-grid-nofloat": ("int8", {**GRID, "float_outliers": 0}),
    "int8-grid-b16": ("int8", {**GRID, "block_size": 16}),
    "int8-grid-b16-oc4": ("int8", {**GRID, "block_size": 16, "outlier_channels": 4}),
    **{f"int8-grid-{part}-fp32": ("int8", {**GRID, "keep_float": [f"layers.*.{path}"]}) for part, path in PARTS},
    **{f"int8-grid-oc{k}": ("int8", {**GRID, "outlier_channels": k}) for k in (4, 8, 16, 32, 64)},
    **{f"int8-grid-oc16-{part}": ("int8", {**GRID, "outlier_channels": 16,
                                           "outlier_channel_patterns": [f"layers.*.{path}"]}) for part, path in PARTS},
    **{f"int8-grid-oc{k}-r10": ("int8", {**GRID, "outlier_channels": k, "outlier_channel_min_ratio": 10.0})
       for k in (4, 8, 16)},
    "int8-grid-oc16-nofloat": ("int8", {**GRID, "outlier_channels": 16, "float_outliers": 0}),
    # the source's own 4-bit codes (scale d, a 4-bit zero point), the offsets corrected in fp32 on the side path
    "int4-grid": ("int4", {**GRID, "source_grid": "exact", "accuracy_level": 4}),  # int8 activations
    **{f"int4-grid-oc{k}": ("int4", {**GRID, "source_grid": "exact", "accuracy_level": 4, "outlier_channels": k})
       for k in (8, 16, 32)},  # int4-grid-oc16: the int4 recipe of a grid source before session 8
    # with fp32 activations (accuracy level 1) instead: the int4 recipe of a grid source ("int4" above) since
    # session 8, whose tuning screen ran under this name
    "int4-grid-acc1": ("int4", {**GRID, "source_grid": "exact", "accuracy_level": 1}),
}


def build_arm(name: str, fp32: Path, out_dir: Path, adapter, layer: int, tokenizer) -> tuple[Path, dict]:
    """The arm's edge graph (built once into ``out_dir``, reused while the fp32 graph is unchanged) and its
    quant report."""
    from edge_client.front import prefill_graph_path
    from partition_tools.quantize import calibration_tokens, kv_calibration_tokens, quantize_front, recipe_for

    edge_quant, spec = ARMS[name]
    if spec is None:
        return fp32, {"mode": "fp32"}
    dst, meta = out_dir / f"{name}.onnx", out_dir / f"{name}.json"
    from_recipe = spec == RECIPE or isinstance(spec, dict) and spec.get("base") in (RECIPE, ROUNDED)
    if from_recipe:
        changes = {} if spec == RECIPE else {k: v for k, v in spec.items() if k != "base"}
        if isinstance(spec, dict) and spec["base"] == ROUNDED:
            changes = {**ROUNDED_SETTINGS, **changes}
        kwargs = {**recipe_for(adapter, layer, edge_quant, tokenizer), **changes}
        if "kv_cache" in changes:
            kwargs["kv_calibration_ids"] = kv_calibration_tokens(tokenizer, adapter.vocab_size)
    else:
        kwargs = dict(spec)
    stamp = {"fp32_graph_bytes": fp32.stat().st_size, "fp32_graph_mtime": fp32.stat().st_mtime,
             "spec": repr({k: v for k, v in kwargs.items() if k != "calibration_ids"})}
    if dst.is_file() and meta.is_file() and (not kwargs.get("prefill") or prefill_graph_path(dst).is_file()):
        saved = json.loads(meta.read_text())
        if saved["stamp"] == stamp:
            return dst, saved["report"]
    if from_recipe:
        report = quantize_front(fp32, dst, edge_quant, **kwargs)
    else:
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        if "smooth_alpha" in kwargs or "float_outliers" in kwargs or kwargs.get("gptq"):
            kwargs["calibration_ids"] = calibration_tokens(tokenizer, adapter.vocab_size)
        if "kv_cache" in kwargs:
            kwargs["kv_calibration_ids"] = kv_calibration_tokens(tokenizer, adapter.vocab_size)
        report = quantize_front(fp32, dst, kwargs.pop("mode"), **kwargs)
    report = {k: v for k, v in report.items() if k != "calibration_ids"}
    meta.write_text(json.dumps({"stamp": stamp, "report": report}))
    return dst, report


def chat_messages(prompt: Prompt) -> list[dict]:
    """A set's item as chat messages: a str is one user message, a tuple the whole list as (role, content)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [{"role": role, "content": content} for role, content in prompt]


def prompt_key(prompt: Prompt) -> str:
    """The item as a str (the references cache's key, the report's label): a str is itself, a message list its
    JSON."""
    return prompt if isinstance(prompt, str) else json.dumps(chat_messages(prompt), ensure_ascii=False)


def chat_ids(tokenizer, question: Prompt) -> list[int]:
    text = tokenizer.apply_chat_template(chat_messages(question), tokenize=False, add_generation_prompt=True)
    return tokenizer(text).input_ids


@torch.no_grad()
def references(lm, prompts: list[Prompt], new: int):
    """Yield (prompt, (prompt ids, greedy answer ids)) of the unsplit fp32 model for each prompt, one at a time
    (the caller saves each, so a stopped run keeps what it computed)."""
    for q in prompts:
        ids = torch.tensor([chat_ids(lm.tokenizer, q)])  # [1, P]
        gen = lm.model.generate(ids, max_new_tokens=new, do_sample=False, num_beams=1,
                                pad_token_id=lm.tokenizer.eos_token_id)
        yield q, (ids[0].tolist(), gen[0, ids.shape[1]:].tolist())


def through_eos(ids: list[int], eos: set[int]) -> list[int]:
    return ids[: next((i + 1 for i, t in enumerate(ids) if t in eos), len(ids))]


def agreement(got: list[int], ref: list[int]) -> int:
    """Reference tokens before the first divergence (len(ref): identical)."""
    n = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
    return len(ref) if got == ref else n


# -- teacher-forced ---------------------------------------------------------------------------------------

def codec_fn(name: str, bundle: Path):
    """Round trip through the wire codec ``name`` (rows independently, as the wire does it)."""
    from partition_tools.evaluate import fp16_round_trip
    from shared.codecs import available_codecs

    if name == "fp16":
        return fp16_round_trip
    codec = available_codecs(json.loads((bundle / "calibration.json").read_text()))[name]
    return lambda x: codec.decode(codec.encode(x))


def coded(edge: np.ndarray, n_prompt: int, codec: str, bundle: Path) -> np.ndarray:
    """The boundary [T, H] as the cloud receives it: prompt rows in the prompt codec, later rows (decode
    steps) in the step codec (``PROMPT/STEP``; one name: both)."""
    prompt_codec, _, step_codec = codec.partition("/")
    step_codec = step_codec or prompt_codec
    if step_codec == prompt_codec:
        return codec_fn(prompt_codec, bundle)(edge)
    return np.concatenate([codec_fn(prompt_codec, bundle)(edge[:n_prompt]),
                           codec_fn(step_codec, bundle)(edge[n_prompt:])])


@torch.no_grad()
def first_divergences(front, back, codecs: list[str], bundle: Path, prompt: list[int], answer: list[int]) -> list[int]:
    """Per codec arm: index of the first answer token the split would not produce greedily (len(answer):
    identical). The edge runs once; each codec's boundary goes through the cloud half."""
    seq = np.asarray(prompt + answer[:-1], np.int64)  # the last answer token is predicted, never fed
    front.reset()
    # the prompt as the edge prefills it, the answer's rows through the decode graph (as decode steps are;
    # per-token activation quantization makes one call over them equal to one call per token)
    edge = np.concatenate([front.prefill(prompt), front.step(answer[:-1])])  # [T, H]
    pos = torch.arange(seq.size)[None]
    out = []
    for codec in codecs:
        logits = back(torch.from_numpy(coded(edge, len(prompt), codec, bundle))[None], pos)[0]  # [T, V]
        pred = logits[len(prompt) - 1:].argmax(-1).numpy()  # predictions of answer[0..]
        miss = np.nonzero(pred != np.asarray(answer))[0]
        out.append(int(miss[0]) if miss.size else len(answer))
    return out


def teacher_arm(bundle: Path, graph: Path, codecs: list[str], refs, threads: int, back,
                prefill: Path | None) -> list[list[dict]]:
    """[codec][prompt] -> {"agree", "identical"} for one edge graph (and its prompt-phase graph ``prefill``,
    if any), teacher-forced."""
    from edge_client.front import FrontRuntime

    front = FrontRuntime(bundle, threads=threads, chunk=512, verify=False, graph=graph, prefill_graph=prefill)
    per_prompt = [first_divergences(front, back, codecs, bundle, p, a) for p, a in refs]  # [prompt][codec]
    return [[{"agree": d[ci], "identical": d[ci] == len(a)} for d, (_, a) in zip(per_prompt, refs)]
            for ci in range(len(codecs))]


# -- served -----------------------------------------------------------------------------------------------

def served_arm(bundle: Path, codecs: list[str], prompts: list[Prompt], refs, new: int, threads: int, log: Path,
               eos: set[int]) -> list[list[dict]]:
    """[codec][prompt] -> {"agree", "identical", "bytes_up", "codec", "edge_variant"}: one server for the bundle, a fresh
    EdgeClient per codec arm (``policy``: the precision policy's choice), greedy ``complete`` per prompt."""
    from edge_client.client import EdgeClient
    from edge_client.config import RetryPolicy
    from edge_client.demo import LocalCloud

    retry = RetryPolicy(connect_timeout_s=10.0, reply_timeout_s=120.0, max_retries=20)
    out = []
    with LocalCloud(bundle, log_path=log) as cloud:
        for codec in codecs:
            rows = []
            with EdgeClient(bundle, cloud.ws_url, retry=retry, threads=threads,
                            codec=None if codec == "policy" else codec) as client:
                for q, (prompt, ref) in zip(prompts, refs):
                    msgs = chat_messages(q)
                    ids = client.tokenizer.encode(client.tokenizer.apply_chat_template(msgs))
                    if ids != prompt:
                        raise RuntimeError(f"the edge tokenizes {q!r} differently from the reference")
                    gen = client.complete(messages=msgs, max_tokens=new, temperature=0.0)
                    got = through_eos(list(gen.token_ids), eos)
                    rows.append({"agree": agreement(got, ref), "identical": got == ref,
                                 "bytes_up": gen.stats.bytes_up,
                                 "codec": f"{gen.stats.codec}/{gen.stats.step_codec}",
                                 "edge_variant": gen.stats.edge_variant})
            out.append(rows)
    return out


# -- the run ----------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = common_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]), "/tmp/edge_answers_bench")
    p.add_argument("--mode", choices=("served", "teacher"), default="served")
    p.add_argument("--prompt-set", choices=tuple(PROMPT_SETS), default="held-out")
    p.add_argument("--arms", default="fp32,int8")
    p.add_argument("--codecs", default="fp16,policy", help="codec arms: policy, a codec, or PROMPT/STEP (teacher)")
    p.add_argument("--prompts", type=int, default=None, help="the first N prompts of the set (default: all)")
    p.add_argument("--new", type=int, default=48, help="greedy answer tokens")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    args.arm_list = choices(p, args.arms, ARMS, "arm")
    args.codec_list = [c.strip() for c in args.codecs.split(",") if c.strip()]
    if args.mode == "served" and any("/" in c for c in args.codec_list):
        p.error("PROMPT/STEP codec arms are teacher-mode only (served: 'policy' or one codec)")
    if args.mode == "teacher" and "policy" in args.codec_list:
        p.error("'policy' needs the served path (--mode served)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from edge_client.front import prefill_graph_path
    from partition_tools.adapters import ModelAdapter
    from partition_tools.models import load_model

    sets = list(PROMPT_SETS.values())
    for a, b in ((a, b) for i, a in enumerate(sets) for b in sets[i + 1:]):
        if set(a) & set(b):
            raise SystemExit(f"prompt sets overlap: {sorted(map(prompt_key, set(a) & set(b)))}")
    started = time.perf_counter()
    lm = load_model(args.model)
    adapter = ModelAdapter(lm.model)
    eos = set(adapter.eos_token_ids())
    bundle = cached_split(lm, args.layer, args.work / "bundle-fp32")
    fp32 = bundle / "edge" / "front.onnx"
    for sub in ("arms", "bundles", "logs"):
        (args.work / sub).mkdir(parents=True, exist_ok=True)
    prompts = PROMPT_SETS[args.prompt_set][:args.prompts]
    cached = args.work / f"references-{args.new}.json"  # the unsplit answers do not depend on the arms
    known = json.loads(cached.read_text()) if cached.is_file() else {}
    missing = [q for q in prompts if prompt_key(q) not in known]
    for i, (q, ref) in enumerate(references(lm, missing, args.new)):
        known[prompt_key(q)] = ref
        cached.write_text(json.dumps(known))
        print(f"reference {i + 1}/{len(missing)}", file=sys.stderr, flush=True)
    refs = [(known[prompt_key(q)][0], through_eos(known[prompt_key(q)][1], eos)) for q in prompts]
    print(f"references: {len(refs)} prompts, {sum(len(a) for _, a in refs)} answer tokens", file=sys.stderr)
    back = None
    if args.mode == "teacher":
        from partition_tools.cloud_half import CloudModel

        back = CloudModel.from_bundle(bundle)
    rows = []
    for arm in args.arm_list:
        graph, report = build_arm(arm, fp32, args.work / "arms", adapter, args.layer, lm.tokenizer)
        t0 = time.perf_counter()
        if args.mode == "teacher":
            prefill = prefill_graph_path(graph) if report.get("prefill") else None
            results = teacher_arm(bundle, graph, args.codec_list, refs, args.threads, back, prefill)
        else:
            arm_bundle = bundle if graph == fp32 else variant_bundle(bundle, graph, ARMS[arm][0], report,
                                                                     args.work / "bundles" / arm)
            results = served_arm(arm_bundle, args.codec_list, prompts, refs, args.new, args.threads,
                                 args.work / "logs" / f"{arm}.log", eos)
        for cname, res in zip(args.codec_list, results):
            rows.append(summarize(arm, cname, prompts, refs, res, report, time.perf_counter() - t0))
            r = rows[-1]
            print(f"{arm} + {cname}: {r['identical_count']}/{r['prompts']} identical, "
                  f"{r['tokens_before_divergence']:.3f} of tokens before divergence", file=sys.stderr, flush=True)
        write(args, lm, prompts, rows, started, argv)
    return 0


def summarize(arm: str, codec: str, prompts: list[Prompt], refs, res: list[dict], report: dict, seconds: float) -> dict:
    agree = [r["agree"] for r in res]
    same = [r["identical"] for r in res]
    row = {"arm": arm, "codec": codec, "identical": float(np.mean(same)), "identical_count": int(sum(same)),
           "prompts": len(refs), "tokens_before_divergence": float(sum(agree) / sum(len(a) for _, a in refs)),
           "mean_tokens_before_divergence": float(np.mean(agree)),
           "mean_answer_tokens": float(np.mean([len(a) for _, a in refs])),
           "diverging": [{"prompt": prompts[i], "at": agree[i], "of": len(refs[i][1])}
                         for i in range(len(refs)) if not same[i]],
           "report": report, "seconds": seconds}
    if "bytes_up" in res[0]:
        row["mean_bytes_up"] = float(np.mean([r["bytes_up"] for r in res]))
        row["codecs_used"] = sorted({r["codec"] for r in res})
        row["edge_variants_used"] = sorted({r["edge_variant"] for r in res})
    return row


def write(args, lm, prompts: list[Prompt], rows: list[dict], started: float, argv) -> None:
    """The report so far (rewritten after every arm, so a long run leaves its finished arms behind)."""
    method = {"served": "real autoglm-cloud serve (fp32 compute) on loopback per edge arm + EdgeClient, greedy",
              "teacher": "teacher-forced greedy comparison through FrontRuntime + codec + fp32 cloud half (offline)"}
    result = {
        "command": "python bench/edge_answers_bench.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        "model": lm.source, "identity": lm.identity, "split_layer": args.layer, "new_tokens": args.new,
        "mode": args.mode, "method": method[args.mode], "prompt_set": args.prompt_set, "prompts": prompts,
        "seconds": time.perf_counter() - started, "loadavg": os.getloadavg(), "arms": rows,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
