"""The fixed English text the built-in tiny model's tokenizer is trained on.

NOTE: changing this text changes the tokenizer (token ids): bump `TINY_VERSION` in `tiny.py`.
"""

CORPUS = """\
The morning was quiet when the first train left the station. A few people stood on the
platform with cups of coffee, reading the news on their phones or watching the clouds move
slowly over the hills. Nobody was in a hurry. The conductor waved, the doors closed, and the
long grey carriages rolled away towards the city.

In the city, the day had already begun. Shops opened their shutters, delivery vans parked on
the corners, and children walked to school in small groups, talking about games, homework and
the weekend. A baker put fresh bread in the window. The smell of it drifted down the street and
made everyone who passed feel a little hungry.

Maria worked at the library near the river. She liked the early hours best, when the rooms
were empty and the only sound was the hum of the lights. She sorted the returned books, fixed a
torn page with clear tape, and wrote a short list of things to do: order new chairs, call the
printer, answer three letters, and plan the reading club for Thursday.

At nine o'clock the doors opened. An old man asked for a book about birds. A student wanted
help with a history essay about ships and trade in the seventeenth century. Two friends came in
to use the computers, and a mother brought her son, who was four years old and wanted a story
about a dragon that was afraid of the dark.

"Can you tell me how the story ends?" the boy asked.
"You will have to read it to find out," Maria said, and smiled.

Learning is a long road with many turns. We read, we ask questions, we make mistakes and try
again. A good question is often more useful than a quick answer. When we explain an idea to
someone else, we understand it better ourselves. Patience, curiosity and practice are the
tools that matter most, and they are free for everyone.

Computers follow simple rules very fast. A program is a list of steps: read the input, check
the numbers, store the result, and repeat until the work is done. Memory is divided into pages,
and each page holds a fixed number of slots. When a page is no longer needed, it goes back to
the free list so that another task can use it. Careful bookkeeping keeps everything in order.

The weather changed in the afternoon. Dark clouds came from the west, the wind grew stronger,
and rain began to fall on the roofs and the empty market square. People opened umbrellas and
hurried home. In the park, the ducks did not seem to mind at all.

Here are some numbers: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16, 20, 32, 64, 100, 128, 256,
512, 1000, 1024 and 2048. Prices went up by 3.5 percent in March; the train costs 12 euros,
and the trip takes 45 minutes. Call 555-0100 before 6 pm, or write to the office.

Questions and answers:
Q: What is the capital of France? A: Paris.
Q: How many days are in a week? A: Seven.
Q: What color is the sky on a clear day? A: Blue.
Q: Which is larger, a mouse or an elephant? A: An elephant.

A short recipe for tomato soup: cut four tomatoes, one onion and a clove of garlic. Cook the
onion in a little oil until it is soft, add the garlic and the tomatoes, pour in two cups of
water, and let it simmer for twenty minutes. Add salt, pepper and a few leaves of basil, then
blend until smooth. Serve it hot with bread.

In the evening the lights came on one by one. The last train returned to the station, the
baker cleaned his ovens, and Maria locked the library door. The river was calm again, and the
moon rose over the bridge. Tomorrow would be another ordinary day, full of small stories.

Thank you for reading. Please let us know if you have any questions, comments or ideas. We are
happy to help, and we will answer as soon as we can.
"""
